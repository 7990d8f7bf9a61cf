"""Import-only stand-in for torchvision (PyPI has no build for this CPU torch): SGLang's model modules import its
image transforms at module level (multimodal helpers); the checks here never call them. Every attribute is a
placeholder class whose own attributes are their names."""

import sys
import types


class _Placeholder(type):
    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__init__": lambda self, *a, **k: None})


for _sub in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops"):
    sys.modules[f"{__name__}.{_sub}"] = _Module(f"{__name__}.{_sub}")
transforms = sys.modules[f"{__name__}.transforms"]
io = sys.modules[f"{__name__}.io"]
ops = sys.modules[f"{__name__}.ops"]
__version__ = "0.0"
