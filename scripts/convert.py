"""Thin wrapper: ``python scripts/convert.py SRC OUT --ep-degree N`` = ``hf-hybrid-ep convert ...``."""

import sys

from hf_hybrid_ep.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
