"""Run the Python blocks of one page as a reader would: in order, in one namespace, top-level ``await``
allowed (``python -m asyncio``). Usage: ``python -m tests.docs.run_python PAGE`` from the folder the
page's programs should run in. Exit 1 naming the block that failed."""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import traceback
from pathlib import Path

from tests.docs.blocks import PYTHON, blocks


def main(page: str) -> int:
    namespace: dict[str, object] = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    ran = 0
    for block in blocks(Path(page)):
        if block.lang not in PYTHON or block.marker == "pytest":
            continue
        try:
            code = compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if block.marker == "compile-only":
                continue
            if code.co_flags & inspect.CO_COROUTINE:
                loop.run_until_complete(eval(code, namespace))
            else:
                exec(code, namespace)
            ran += 1
        except BaseException:
            print(f"the Python block at {block.where} failed:", file=sys.stderr)
            traceback.print_exc()
            return 1
    loop.close()
    print(f"ran {ran} Python block(s) of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
