"""``lightning-flagscale``: LightningCLI for training recipes, plus conversion.

    lightning-flagscale fit --config recipes/llama_tiny.yaml [--trainer.max_steps 50 ...]
    lightning-flagscale validate --config recipes/llama_tiny.yaml --ckpt_path ckpt/
    lightning-flagscale convert hf-to-ckpt HF_DIR OUT | ckpt-to-hf CKPT OUT
    lightning-flagscale tune --preset llama3-8b --devices 64   best layouts by a memory + cost model
    lightning-flagscale bench [--quick]    FlagScale layouts next to Lightning's strategies (repository checkout)

A recipe is a plain LightningCLI YAML file: ``trainer`` (with ``strategy: class_path: ...FlagScaleStrategy``),
``model`` (``CausalLMModule`` arguments) and ``data`` (``LMDataModule`` arguments), or ``model`` / ``data`` with a
``class_path`` (e.g. ``VLMModule`` / ``VLMDataModule`` in ``qwen2_5_vl_tiny.yaml``). Recipes shipped with the
package can be named without a path: ``--config llama_tiny`` finds ``lightning_flagscale/recipes/llama_tiny.yaml``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "recipe_path"]

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_path(name: str) -> str:
    """A recipe file: an existing path, or the name of a recipe shipped in ``lightning_flagscale/recipes``."""
    if os.path.exists(name):
        return name
    base = Path(name).name
    candidate = RECIPES_DIR / (base if base.endswith((".yaml", ".yml")) else f"{base}.yaml")
    if candidate.exists():
        return str(candidate)
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise SystemExit(f"Recipe {name!r} not found; give a path or one of: {', '.join(shipped)}.")


def _resolve_config_args(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = recipe_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + recipe_path(arg.split("=", 1)[1])
    return out


def _names_classes(argv: list[str]) -> bool:
    """Whether a ``--config`` recipe gives ``model: {class_path: ...}`` (e.g. ``VLMModule``) instead of
    ``CausalLMModule`` arguments."""
    import yaml

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else path
        if path and os.path.isfile(path):
            model = (yaml.safe_load(Path(path).read_text()) or {}).get("model")
            if isinstance(model, dict) and "class_path" in model:
                return True
    return False


def _lightning_cli(argv: list[str]) -> None:
    import lightning as L
    from lightning.pytorch.cli import LightningCLI

    import lightning_flagscale  # noqa: F401  (registers the strategy)
    from lightning_flagscale.data import LMDataModule
    from lightning_flagscale.models import CausalLMModule

    args = _resolve_config_args(argv)
    if _names_classes(args):
        # Recipes with `model: {class_path: ...}` pick their LightningModule and DataModule (e.g. the VLM recipe);
        # the converters are imported so that modules with HF hooks (VLMModule.from_hf / hf_dir) have them.
        from lightning_flagscale import convert  # noqa: F401

        LightningCLI(
            L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
            save_config_kwargs={"overwrite": True}, args=args,
        )  # fmt: skip
        return
    LightningCLI(
        CausalLMModule,
        LMDataModule,
        subclass_mode_model=False,
        subclass_mode_data=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        from lightning_flagscale.convert.cli import convert_main

        convert_main(argv[1:])
        return
    if argv and argv[0] == "tune":
        from lightning_flagscale.tune import tune_main

        tune_main(argv[1:])
        return
    if argv and argv[0] == "bench":
        from lightning_flagscale.bench_cli import bench_main

        bench_main(argv[1:])
        return
    if argv and argv[0] in ("recipes", "list-recipes"):
        for path in sorted(RECIPES_DIR.glob("*.yaml")):
            first = path.read_text().splitlines()[0].lstrip("# ").strip()
            print(f"{path.stem:<24} {first}")
        return
    _lightning_cli(argv)


if __name__ == "__main__":
    main()
