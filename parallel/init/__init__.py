"""Initial values of a partitioned model under the unpartitioned model's names (Note [initial values] in
parallel/init/values.py; Note [initialization by name] in parallel/init/by_name.py)."""
from parallel.init.by_name import check_initializable, full_init_value, name_seed
from parallel.init.plan import InitEntry, InitPlan, init_plan, materialize_and_init
from parallel.init.values import Blank, ByName, FromFiles, Values

__all__ = ["Blank", "ByName", "FromFiles", "InitEntry", "InitPlan", "Values", "check_initializable",
           "full_init_value", "init_plan", "materialize_and_init", "name_seed"]
