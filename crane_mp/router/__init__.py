"""Several models behind one port: each model's own processes, a router that forwards by `model`, one memory budget."""
