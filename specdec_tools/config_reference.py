"""docs/configuration.md, generated from the pydantic models that validate serve_config.yaml.

The descriptions live on the fields (`Field(description=...)`), so the reference cannot
drift from what is validated: a test regenerates it and compares with the committed file.
Run `python -m specdec_tools.config_reference` after changing a field.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from deployments.app_config import AppArgs

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from the pydantic models that validate it (`python -m specdec_tools.config_reference`;
a test fails when this file and the models disagree). Every key goes under an
application's `args:` in `serve_config.yaml`; the same keys drive `specdec generate
--config` and the benchmarks, so what they measure is what is served. A bad value stops the
deploy with pydantic's message naming the key.

Minimal:

```yaml
applications:
  - name: specdec
    route_prefix: /
    import_path: deployments.app:app
    args:
      target: {model: qwen2.5-coder-1.5b, dtype: q4k, threads: 2,
               resources: {num_cpus: 2}}
      draft: {model: qwen2.5-coder-0.5b, dtype: int4,
              resources: {num_cpus: 0}}
```
"""


def _models(annotation) -> list[type[BaseModel]]:
    """The BaseModel classes inside a field's annotation (X, X | None, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    return []


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(annotation))  # bare class names
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "(see below)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default!r}`" if field.default is not None else "none"


def _section(prefix: str, model: type[BaseModel], out: list[str], nested: list) -> None:
    doc = (model.__doc__ or "").strip().splitlines()
    out += [f"## `{prefix or 'args'}`", "", doc[0] if doc else "", "",
            "| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in _flat_fields(model):
        key = f"{prefix}.{name}" if prefix else name
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {desc} |")
        nested += [(key, m) for m in _models(field.annotation)]
    out.append("")


def _flat_fields(model: type[BaseModel]):
    """The fields as the YAML writes them: AppArgs holds its EngineSpec as `engine`, whose
    keys are written flat beside the app's own."""
    for name, field in model.model_fields.items():
        if model is AppArgs and name == "engine":
            yield from field.annotation.model_fields.items()
        else:
            yield name, field


def render() -> str:
    out = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("", AppArgs)]
    seen = set()
    while queue:
        prefix, model = queue.pop(0)
        if (prefix, model) in seen:
            continue
        seen.add((prefix, model))
        nested: list = []
        _section(prefix, model, out, nested)
        queue += nested
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
