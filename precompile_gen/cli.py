"""``precompile-gen``: the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from precompile_gen.errors import PrecompileError

_EPILOG = """\
examples:
  precompile-gen demo                      precompile the built-in example, reload
                                           it in a fresh process, compare with eager
  precompile-gen demo --backend eager --out /tmp/demo
  precompile-gen stubs build/stubs         render every template for type checking
"""


def _demo(args: argparse.Namespace) -> int:
    from precompile_gen import demo

    report = demo.run(args.backend, Path(args.out))
    print()
    print(f"backend              {args.backend}")
    print(f"precompile           {report['precompile_seconds']:.1f} s")
    print(f"fresh-process reload {report['reload_first_result_seconds']:.1f} s")
    print(f"artifact             {report['artifact_bytes']:,} bytes")
    print(f"cache                {report['cache_bytes']:,} bytes")
    print(
        f"matches eager        loss {report['loss']:.4f}, "
        f"{report['params_checked']} parameter grads, "
        f"{report['buffers_checked']} buffers"
    )
    return 0


def _stubs(args: argparse.Namespace) -> int:
    from precompile_gen.stubs import write_stubs

    for path in write_stubs(Path(args.out_dir)):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precompile-gen",
        description="Precompile whole PyTorch computations into readable artifacts.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="precompile a small CNN training step and check it against eager",
        description=(
            "Precompile a built-in CNN training step (with BatchNorm), write the "
            "artifact and cache to --out, reload them in a fresh process and compare "
            "loss, gradients and buffers with eager PyTorch."
        ),
    )
    demo.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    demo.add_argument(
        "--out", default="precompile-demo", help="folder for the pair (created)"
    )
    demo.set_defaults(run=_demo)
    stubs = commands.add_parser(
        "stubs",
        help="render every template into .py files for type checking",
        description=(
            "Render each backend's artifact with typed placeholder metadata and a "
            "typed "
            "stand-in for the compiled graph, for `pyrefly check OUT_DIR`."
        ),
    )
    stubs.add_argument("out_dir", help="folder for the stub files (created)")
    stubs.set_defaults(run=_stubs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (PrecompileError, RuntimeError, OSError) as error:
        print(f"precompile-gen {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
