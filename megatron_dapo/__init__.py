"""megatron_dapo: DAPO (arXiv 2503.14476) on Megatron-Core. See docs/architecture.md."""

__version__ = "0.1.0"
