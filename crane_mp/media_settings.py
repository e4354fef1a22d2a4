"""mm_processor_kwargs (vLLM's name) as this server takes them, per server (--mm-processor-kwargs) and
per request: the pixel bounds an image processor resizes every image to. Dependency-free, so the
launcher and the frontend check them alike."""

from __future__ import annotations

from typing import Any

PIXEL_SETTINGS = ("min_pixels", "max_pixels")


def pixel_settings_problem(kwargs: Any) -> str | None:
    """What is wrong with `kwargs` (None: nothing): an object of min_pixels / max_pixels, positive
    integers, min_pixels at most max_pixels."""
    if not isinstance(kwargs, dict):
        return "must be an object"
    unknown = sorted(set(kwargs) - set(PIXEL_SETTINGS))
    if unknown:
        return f"{', '.join(unknown)} not taken; this server takes {' and '.join(PIXEL_SETTINGS)}"
    for key, value in kwargs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"{key} must be a positive integer, not {value!r}"
    if "max_pixels" in kwargs and kwargs.get("min_pixels", 0) > kwargs["max_pixels"]:
        return "min_pixels is above max_pixels"
    return None
