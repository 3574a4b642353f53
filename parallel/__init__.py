"""parallel: train a PyTorch model too large or too slow for one device (see README.md)."""
