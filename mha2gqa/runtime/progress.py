"""The package's one progress helper: bars that cost nothing when they are off. tqdm is imported only for a
bar that is shown, and then its plain terminal class unless IPython is running (tqdm.auto also imports
asyncio for its async variant, and tqdm itself importlib.metadata: together about a tenth of a second of a
conversion's start-up, more than copying a few hundred MB takes)."""

from __future__ import annotations

import sys


class _Off:
    """What a disabled bar is asked to do, done as nothing; iterated, it yields what it wraps."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(() if self.iterable is None else self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass


def progress_bar(total: float | None, desc: str, enabled: bool, iterable=None, **kwargs):
    """tqdm(iterable, total=..., desc=..., **kwargs) when `enabled`, else an object that does nothing (and
    iterated, yields `iterable`)."""
    if not enabled:
        return _Off(iterable)
    if "IPython" in sys.modules:  # a notebook: tqdm.auto picks its widget bar
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(iterable, total=total, desc=desc, **kwargs)


def _open_bars() -> list:
    """Every tqdm bar still open, ours and the libraries' (transformers', tqdm.auto's and the notebook's bars are
    subclasses, each of which may keep its own set)."""
    std = sys.modules.get("tqdm.std")
    if std is None:  # no bar was ever made
        return []
    classes, open_bars = [std.tqdm], []
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        open_bars += [bar for bar in list(cls.__dict__.get("_instances", ())) if bar not in open_bars]
    return open_bars


def write_line(text: str, err: bool = True) -> None:
    """`text` on a line of its own, on stderr (or stdout), whatever bars are drawn: with a bar open, through
    tqdm.write, which clears the bars, prints the line and draws them again below it. Printed plainly, a
    `Warning:` line landed on the bar's line ("convert: 40%|####  | Warning: ...") and the bar redrew over it.
    Every warning the CLI shows goes through here (cli/__init__.py)."""
    stream = sys.stderr if err else sys.stdout
    if _open_bars():
        sys.modules["tqdm.std"].tqdm.write(text, file=stream)
    else:
        print(text, file=stream, flush=True)


def close_open_bars() -> None:
    """Close every tqdm bar still open (ours and the libraries'), before a line that ends the program: a
    bar left open holds the cursor, so the `Error:` line was printed on the bar's line, and the bar redrew
    itself after it when it was collected."""
    for bar in _open_bars():
        bar.close()
