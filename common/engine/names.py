"""Model names, kept apart from model.py so that settings and the CLI can name models without
importing torch (`streamvqa ask` and `status` start in well under a second)."""

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
RANDOM_MODELS = ("tiny-random", "random-3b")  # built from config in model.py: no weights to download
