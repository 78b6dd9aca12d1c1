"""``precompile-gen``: the command line.

Every command reports an error as one line on stderr, ``precompile-gen COMMAND:
error: ...``, and exits non-zero. ``inspect``, ``verify`` and ``diff`` read artifacts
as text and never execute them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import TypeAlias

from precompile_gen.runtime.errors import PrecompileError

_EPILOG = """\
examples:
  precompile-gen demo                      precompile the built-in example, reload
                                           it in a fresh process, compare with eager
  precompile-gen inspect step.py           what an artifact holds and expects
  precompile-gen verify step.py step.cache check that the two files belong together
  precompile-gen diff old.py new.py        compare two artifacts section by section

Run `precompile-gen COMMAND --help` for each command's options and examples.
"""

_DEMO_EPILOG = """\
examples:
  precompile-gen demo
  precompile-gen demo --backend eager --out /tmp/demo

Progress goes to stderr (a live line on a terminal, log lines otherwise); the
report goes to stdout.
"""

_INSPECT_EPILOG = """\
examples:
  precompile-gen inspect step.py
  precompile-gen inspect step.py --json | python -m json.tool

The file is parsed, never executed: inspecting an untrusted artifact is safe.
"""

_VERIFY_EPILOG = """\
examples:
  precompile-gen verify step.py step.cache
  precompile-gen verify step.py step.cache --key-file secret.key
  PRECOMPILE_KEY=... precompile-gen verify step.py step.cache --key-env PRECOMPILE_KEY
  precompile-gen verify --rebuild step.py step.cache

Exits 0 when the pair belongs together, 1 with the reason otherwise. Neither file is
executed. The key is read from a file or an environment variable, never from the
command line, where other users of the machine could see it. --rebuild compiles the
artifact's kernels again, C++ and Triton's for a GPU (the compilers run on their
source, nothing of the pair is executed; a GPU's kernels build without the GPU), and
exits 1 if a binary in the cache is not what its kernel builds to.
"""

_DIFF_EPILOG = """\
examples:
  precompile-gen diff old/step.py new/step.py
  precompile-gen diff --summarize-kernels old/step.py new/step.py
  precompile-gen diff <(git show HEAD:tests/golden/eager_train_step.py) \\
      tests/golden/eager_train_step.py

Exits 0 when the artifacts are identical, 1 when they differ, 2 on an error (as
diff does). Hunk headers give the artifacts' own line numbers.
"""

# What add_subparsers returns: each command adds its own parser to it.
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

# diff's 1 means "they differ", so its errors exit 2, as diff(1)'s do.
_ERROR_EXIT = {"diff": 2}


class CommandError(Exception):
    """A problem with the command's arguments or files, reported as one line."""


def _demo(args: argparse.Namespace) -> int:
    from precompile_gen.tools import demo

    report = demo.run(args.backend, Path(args.out))
    sys.stdout.write(demo.format_report(report))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from precompile_gen.tools.inspection import inspect_artifact
    from precompile_gen.tools.report_text import format_report

    text = _read_artifact(args.artifact)
    try:
        report = inspect_artifact(text, args.artifact)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as error:
        # parse_metadata checks that each constant is a literal, not its type or
        # length; an edited artifact can break the assumptions made here.
        raise CommandError(
            f"the artifact {args.artifact} has metadata of unexpected types or lengths "
            f"({type(error).__name__}: {error}); it was edited or made by another "
            "version of precompile_gen"
        ) from None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(format_report(report))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from precompile_gen.tools.verify import format_report, verify_pair

    text = _read_artifact(args.artifact)
    cache = _read_bytes(args.cache, "cache")
    report = verify_pair(text, cache, key=_key(args))
    sys.stdout.write(format_report(report, args.artifact, args.cache))
    if not args.rebuild:
        return 0
    from precompile_gen.tools import rebuild

    rebuilt = rebuild.rebuild_report(text, cache)
    sys.stdout.write(rebuild.format_rebuild(rebuilt))
    return 0 if rebuild.matches(rebuilt) else 1


def _diff(args: argparse.Namespace) -> int:
    from precompile_gen.tools.diff import diff_artifacts

    text, differs = diff_artifacts(
        _read_artifact(args.a),
        _read_artifact(args.b),
        args.a,
        args.b,
        summarize_kernels=args.summarize_kernels,
        context=args.context,
    )
    sys.stdout.write(text)
    return 1 if differs else 0


def _read_bytes(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CommandError(f"the {what} {path} does not exist") from None
    except OSError as error:
        raise CommandError(
            f"cannot read the {what} {path}: {error.strerror or error}"
        ) from None


def _read_artifact(path: str) -> str:
    data = _read_bytes(path, "artifact")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CommandError(
            f"the artifact {path} is not UTF-8 text; pass the .py file precompile() "
            "wrote (a .cache file goes in the CACHE position of verify)"
        ) from None


def _key(args: argparse.Namespace) -> bytes | None:
    if args.key_file is not None:
        # Exactly the file's bytes: a key is binary, so nothing is stripped.
        return _read_bytes(args.key_file, "key file")
    if args.key_env is not None:
        value = os.environ.get(args.key_env)
        if not value:
            raise CommandError(
                f"the environment variable {args.key_env} is unset or empty; set it "
                "to the key the pair was signed with"
            )
        return value.encode("utf-8")
    return None


def _wrap(text: str) -> str:
    # The raw formatter keeps the examples' layout, so descriptions are wrapped here.
    return textwrap.fill(text, width=79)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precompile-gen",
        description=_wrap(
            "Precompile whole PyTorch computations into readable artifacts, and "
            "inspect, verify and compare those artifacts."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_inspect(commands)
    _add_verify(commands)
    _add_diff(commands)
    return parser


def _add_demo(commands: _Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="precompile a small CNN training step and check it against eager",
        description=_wrap(
            "Precompile a built-in CNN training step (with BatchNorm), write the "
            "artifact and cache to --out, reload them in a fresh process and compare "
            "loss, gradients and buffers with eager PyTorch; print the seconds each "
            "stage took."
        ),
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    demo.add_argument(
        "--out", default="precompile-demo", help="folder for the pair (created)"
    )
    demo.set_defaults(run=_demo)


def _add_inspect(commands: _Commands) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="show what an artifact holds and expects, without executing it",
        description=_wrap(
            "Show an artifact's backend, the traced function's signature, its "
            "modules' parameters and buffers, the user inputs it accepts (with "
            "dynamic dims and bounds), its result, its kernels or operators and the "
            "size of each section."
        ),
        epilog=_INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("artifact", metavar="ARTIFACT", help="the artifact (.py)")
    inspect.add_argument(
        "--json", action="store_true", help="print the same data as JSON"
    )
    inspect.set_defaults(run=_inspect)


def _add_verify(commands: _Commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="check that an artifact and a cache belong together",
        description=_wrap(
            "Check an artifact and a cache as load() does before executing anything: "
            "the artifact's metadata, the cache's envelope, backend and code_hash, "
            "the kernel binaries' digests, and the signature when a key is given."
        ),
        epilog=_VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("artifact", metavar="ARTIFACT", help="the artifact (.py)")
    verify.add_argument("cache", metavar="CACHE", help="the cache (.cache)")
    key = verify.add_mutually_exclusive_group()
    key.add_argument(
        "--key-file", metavar="PATH", help="file holding the signing key (raw bytes)"
    )
    key.add_argument(
        "--key-env",
        metavar="NAME",
        help="environment variable holding the signing key (as UTF-8 text)",
    )
    verify.add_argument(
        "--rebuild",
        action="store_true",
        help=(
            "also compile the artifact's kernels from its own text, in a fresh "
            "folder, and check each binary in the cache against the artifact's pins "
            "(exit 1 if one differs)"
        ),
    )
    verify.set_defaults(run=_verify)


def _add_diff(commands: _Commands) -> None:
    diff = commands.add_parser(
        "diff",
        help="compare two artifacts section by section",
        description=_wrap(
            "Compare two artifacts section by section: a unified diff of the header, "
            "the graph and the driver, and the metadata compared constant by "
            "constant. For reviewing template changes and regenerated goldens."
        ),
        epilog=_DIFF_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("a", metavar="A", help="the old artifact (.py)")
    diff.add_argument("b", metavar="B", help="the new artifact (.py)")
    diff.add_argument(
        "--summarize-kernels",
        action="store_true",
        help="show each kernel's source string as one line (name, length, sha256)",
    )
    diff.add_argument(
        "--context",
        type=int,
        default=3,
        metavar="N",
        help="lines of context around each change (default 3)",
    )
    diff.set_defaults(run=_diff)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CommandError, PrecompileError, RuntimeError, ValueError, OSError) as error:
        # One line, so that scripts and CI logs show the whole reason.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"precompile-gen {args.command}: error: {message}", file=sys.stderr)
        return _ERROR_EXIT.get(args.command, 1)
    except KeyboardInterrupt:
        print(f"precompile-gen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
