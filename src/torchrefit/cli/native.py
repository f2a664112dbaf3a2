"""``torchrefit native build|status``: the optional C++ form of ``watch="every"``'s
per-refit checks (``torchrefit._native.watch``) and of delta refits' CPU diff and apply
(``torchrefit._native.delta``), built once per environment."""

from __future__ import annotations

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("native", help="build or show the optional C++ per-refit checks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("build", "status"),
                   help="build: compile it for this torch and Python (a C++ compiler "
                        "needed); status: whether it is built and will be used")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument("--background", action="store_true",
                   help="as a Refitter starts it: quietly, leaving any error in the build folder")
    p.set_defaults(run=_run)


def _run(args) -> int:
    from torchrefit._native import watch as native
    from torchrefit._native.build import failure_marker, run_background_build

    if args.action == "build" and args.background:
        return run_background_build()
    _delta(args)
    if args.action == "build":
        try:
            path = native.build(verbose=args.verbose)
        except Exception as e:  # noqa: BLE001 (no compiler, a read-only cache: say so)
            print(f"torchrefit native: the build failed ({type(e).__name__}: {e}); "
                  "refits use the Python checks")
            return 1
        print(f"torchrefit native: built {path}")
    where = native.built_path()
    failed = None if where is None else failure_marker(where)
    if failed is not None and failed.exists():
        if args.action == "build":  # built by hand now: later Refitters may build again
            failed.unlink()
        else:
            print(f"torchrefit native: the last background build failed: {failed.read_text().strip()}")
    used = native.module() is not None
    print(f"torchrefit native: {'used' if used else 'not used'} "
          f"({where if where is not None else 'the kernel cache is off'}"
          f"{'' if used or where is None else ': not built there'})")
    return 0 if used or args.action == "status" else 1


def _delta(args) -> None:
    from torchrefit._native import delta

    if args.action == "build":
        try:
            print(f"torchrefit native: built {delta.build(verbose=args.verbose)} (delta kernels)")
        except Exception as e:  # noqa: BLE001 (no compiler: delta refits use torch ops)
            print(f"torchrefit native: the delta kernels' build failed ({type(e).__name__}: {e}); "
                  "delta refits use torch ops")
    where = delta.built_path()
    built = where is not None and (where / "torchrefit_native_delta.so").is_file()
    print(f"torchrefit native: delta kernels {'built' if built else 'not built'} "
          f"({where if where is not None else 'the kernel cache is off'})")
