#!/usr/bin/env python3
"""Calibration files for the README's calibration-domain measurement (issue 23's Moby-Dick goals).

The quality table calibrates on the speeches before 2000 and evaluates on the first 40 windows of the
2001–2016 speeches and of Moby-Dick. To see how much of Moby-Dick's gap is the calibration's domain, this
writes two other calibration texts that share no text with either evaluation:

  OUT/moby-tail.txt  Moby-Dick from character 300,000 on (from the next blank line); the evaluation's first
                     40 × 512 tokens lie in the first ~80,000 characters
                     (the demo tokenizer: 23,433 tokens in the first 90,000).
  OUT/mix.txt        the latest speeches before 2000, whole, back in time until they hold as many characters
                     as moby-tail.txt, in their order, then moby-tail.txt: about half of each.

Usage: python3 scripts/domain_calib.py OUT_DIR   (after scripts/texts.py has unpacked data/texts)
"""
import pathlib
import sys

SKIP_CHARS = 300_000


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: domain_calib.py OUT_DIR")
    out = pathlib.Path(sys.argv[1])
    texts = pathlib.Path(__file__).resolve().parent.parent / "data" / "texts"
    moby = (texts / "moby-dick.txt").read_text(encoding="utf-8")
    rest = moby[SKIP_CHARS:]
    tail = rest[rest.index("\n\n") + 2 :]
    speeches = sorted(
        p for p in (texts / "sotu").glob("*.txt") if int(p.name.split("_")[0]) < 2000
    )
    if not speeches:
        sys.exit(f"no speeches before 2000 under {texts / 'sotu'}: run scripts/texts.py first")
    parts, chars = [], 0
    for p in reversed(speeches):
        t = p.read_text(encoding="utf-8")
        parts.append(t)
        chars += len(t)
        if chars >= len(tail):
            break
    out.mkdir(parents=True, exist_ok=True)
    (out / "moby-tail.txt").write_text(tail, encoding="utf-8")
    (out / "mix.txt").write_text("\n\n".join(reversed(parts)) + "\n\n" + tail, encoding="utf-8")
    print(
        f"{out / 'moby-tail.txt'}: {len(tail)} characters; {out / 'mix.txt'}: {len(parts)} speeches "
        f"({chars} characters, from {speeches[-len(parts)].name}) + the tail"
    )


if __name__ == "__main__":
    main()
