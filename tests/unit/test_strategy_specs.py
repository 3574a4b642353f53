"""The strategy table (Note [strategy table] in parallel/strategy_specs.py): every strategy has a row, a schema,
a config file and (unless it chooses another) a builder, and no code outside the table compares a strategy's
name with a literal."""
import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from parallel.planning.auto import _strategy, candidates, recomputed
from parallel.strategies import STRATEGIES
from parallel.strategy_specs import SCHEMAS, SPECS, StrategyConfig, pipelined, takers, tensor_parallel
from tests.unit.test_configs import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "strategy"


def test_every_strategy_has_a_row_a_schema_a_config_and_a_builder():
    assert set(SPECS) == {f.stem for f in CONF.glob("*.yaml")} == set(SCHEMAS)
    assert set(STRATEGIES) == {name for name, spec in SPECS.items() if not spec.chooses}


@pytest.mark.parametrize("name", list(SPECS))
def test_each_schema_holds_its_rows_keys_typed_as_the_full_config(name):
    fields = {f.name: f for f in dataclasses.fields(SCHEMAS[name])}
    assert set(fields) == {"name", *SPECS[name].keys}
    assert fields["name"].default == name
    types, full = typing.get_type_hints(SCHEMAS[name]), typing.get_type_hints(StrategyConfig)
    for key in SPECS[name].keys:
        assert types[key] == full[key], key
        assert getattr(SCHEMAS[name](), key) == getattr(StrategyConfig(), key), key


@pytest.mark.parametrize("name", list(SPECS))
def test_each_config_file_is_typed_by_its_schema_and_sets_only_its_keys(name):
    text = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert text["defaults"][0] == f"/strategy_schema/{name}@_here_"
    assert set(text) - {"defaults", "name"} <= set(SPECS[name].keys)
    node = compose_cfg([f"strategy={name}"]).strategy
    assert OmegaConf.get_type(node) is SCHEMAS[name] and node.name == name


def test_hybrid_takes_the_keys_of_every_strategy_it_combines():
    hybrid = SPECS["hybrid"]
    composed = [n for n, s in SPECS.items() if len(s.spreads) == 1 and set(s.spreads) <= set(hybrid.spreads)]
    assert sorted(composed) == ["context", "data", "expert", "model", "pipeline"]
    for name in composed:
        assert set(SPECS[name].keys) <= set(hybrid.keys), name
    assert takers("zero") == ["data", "context", "expert", "hybrid"]


@pytest.mark.parametrize("name,degrees,stages,split", [
    ("pipeline", {"pp": 1}, True, False),  # a one-stage pipeline is still a pipeline
    ("model", {"tp": 1}, False, True),
    ("hybrid", {"pp": 1, "tp": 1}, False, False),  # combined: each piece where its degree is above 1
    ("hybrid", {"pp": 2, "tp": 1}, True, False),
    ("hybrid", {"pp": 1, "tp": 2}, False, True),
    ("data", {"dp": 2}, False, False),
    ("offload", {}, False, False),
])
def test_pipelines_and_tensor_parallel_come_from_the_row_and_the_degrees(name, degrees, stages, split):
    s = StrategyConfig(name=name, **degrees)
    assert (pipelined(s), tensor_parallel(s)) == (stages, split)


@pytest.mark.parametrize("world,experts", [(1, False), (2, False), (4, True), (6, True)])
def test_auto_candidates_set_only_their_strategies_keys(world, experts):
    found = candidates(world, experts=experts)
    found += [again for again in map(recomputed, found) if again is not None]
    for cand in found:
        keys = {o.partition("=")[0].split(".", 1)[1] for o in cand.overrides if o.startswith("strategy.")}
        assert keys <= set(SPECS[_strategy(cand)].keys), (cand.name, keys)


# Strategy names that are no other config's names (data, model and auto are also groups and values).
OWN_NAMES = {"single", "pipeline", "context", "expert", "hybrid", "offload"}


def named_comparisons(source: str, listings: bool = True) -> list[str]:
    """Where `source` asks a strategy's name instead of its row of the table: a comparison of something named
    `strategy` or `s.name` with a strategy's name, of any `.name` with a name no other config has, or with a
    `strategy=NAME` override; and (`listings`) tuples, lists, sets or dict keys listing such names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [c for o in operands for c in _strings(o)]
            code = " ".join(ast.unparse(o) for o in operands if not _strings(o))
            strategy = "strategy" in code or "s.name" in code
            if any(v in SPECS and strategy or v in OWN_NAMES and ".name" in code or v.startswith("strategy=")
                   for v in literals):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif listings and isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            listed = {c for o in (node.keys if isinstance(node, ast.Dict) else node.elts) for c in _strings(o)}
            if len(listed & OWN_NAMES) >= 2:
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


@pytest.mark.parametrize("code", [
    's.name == "hybrid"', 'cfg.strategy.name != "offload"', 's.name in ("model", "hybrid")',
    'cfg.strategy.name == "auto"', 'cfg.strategy.name not in ("data", "context", "hybrid", "expert")',
    '"strategy=offload" in cand.overrides', 'COMPILED = ("single", "data", "model", "pipeline")',
    'SPREAD = {"single": None, "data": "dp", "pipeline": "pp"}', 'x = s.name == "pipeline" or s.pp > 1',
])
def test_the_check_finds_a_strategy_named_in_code(code):
    assert named_comparisons(code)


def test_no_code_outside_the_table_compares_a_strategy_name():
    """Everything asks a row's capability or a degree (Note [strategy table]); the table is where the names are,
    and the builder registry (parallel/strategies/__init__.py) lists them as its keys."""
    registry = ROOT / "parallel" / "strategies" / "__init__.py"
    found = []
    for path in sorted([*(ROOT / "parallel").rglob("*.py"), *(ROOT / "launch").glob("*.py")]):
        if path != ROOT / "parallel" / "strategy_specs.py":
            hits = named_comparisons(path.read_text(), listings=path != registry)
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in hits]
    assert not found, found
