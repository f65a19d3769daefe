"""Where a service's model comes from: the configured checkpoint dir, or the bundled tiny model."""

from __future__ import annotations

from pathlib import Path


def resolve_model_path(path: Path | str | None) -> Path:
    if path is None:
        from rlbus.tiny_model import ensure_default_model

        return ensure_default_model()
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={resolved} is not a Hugging Face checkpoint dir (no config.json)"
        )
    return resolved
