"""Write Shoal's tiny demo models (random seeded weights, locally trained tokenizer) under a models root.

    python scripts/make_demo_models.py --models-root DIR [--force] [--model KEY ...]

Complete models are skipped unless --force. Nothing is downloaded. Prints one line per model
(key, directory, architecture, parameters) on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.cli.demo_models import DEMO_MODEL_KEYS, make_demo_models
from shoal.shared.logs import configure_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models-root", type=Path, required=True, help="directory that holds the models")
    parser.add_argument("--force", action="store_true", help="rewrite models that are already complete")
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        choices=DEMO_MODEL_KEYS,
        help="make only this model (repeatable; default: all)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging()  # to stderr: stdout is the list of models alone
    for model in make_demo_models(args.models_root, force=args.force, names=args.models):
        directory = args.models_root / model.path
        print(f"{model.key}\t{directory}\t{model.architecture}\t{model.num_parameters:,} params")


if __name__ == "__main__":
    main()
