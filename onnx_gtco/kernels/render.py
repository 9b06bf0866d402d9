"""The generated C++ from Jinja2 templates under plugins/ (shipped with the C++ sources they instantiate).

Strict: a variable or macro argument the caller did not pass is an error, never an empty string. Python computes
plain data (names, numbers, lists); the templates lay it out. The `c` filter writes a string as a C literal.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2

from onnx_gtco.kernels.toolchain import PLUGINS_DIR


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(PLUGINS_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["c"] = lambda s: json.dumps(str(s), ensure_ascii=True)
    return env


def render(template: str, **data: Any) -> str:
    """`template` (a path under plugins/) filled with `data`."""
    return environment().get_template(template).render(**data)


def macro(template: str, which: str, **data: Any) -> str:
    """The macro `which` of `template` called with `data`."""
    return str(getattr(environment().get_template(template).module, which)(**data))


__all__ = ["environment", "macro", "render"]
