"""kdcache: knowledge distillation where the teacher runs once."""
__version__ = "0.1.0"
