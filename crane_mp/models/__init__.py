"""Model facts, torch-free: which architectures are served and how their checkpoints and GGUF files are
read (registry.py, config.py, gguf_file.py), how a model splits over ranks (sharding.py), and what an
embedding or score model pools and scores (pooling.py, score_head.py). Every process reads models
through here; only the worker builds them (crane_mp/worker/models/)."""
