"""The kernel families' tests (one folder each): they build custom-op libraries, so they skip where g++ is missing
(plugin_helpers._need_cxx)."""

from __future__ import annotations

from plugin_helpers import _need_cxx  # noqa: F401 (an autouse fixture)
