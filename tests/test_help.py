"""``--help``: every flag has a short help and shows its default once.

The help is read at 80 columns (argparse's width when the terminal's is unknown). The
--snake-* flags are also rendered as Megatron-LM's parser shows them (argparse's plain
HelpFormatter, which appends no defaults: the plug-in adds them there), and so are the
tokenizer flags (tools/preprocess_data.py's plain parser)."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_snake.training.arguments import OneLineHelpFormatter, build_parser
from megatron_snake.training.snake_args import add_snake_args
from megatron_snake.training.tokenizer import add_tokenizer_args

COLUMNS = 80
MAX_HELP_LINES = 2      # lines of help text per flag (measured: at most 2, most 1)
MAX_TOTAL_LINES = 310   # the whole --help (measured 267; 459 before one-line helps)


@pytest.fixture(autouse=True)
def _columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(COLUMNS))


def _blocks(help_text: str) -> dict[str, list[str]]:
    """Each option's lines in the formatted help, by its first option string: the line
    naming it (``  --flag METAVAR``, perhaps with help after two or more spaces) and the
    indented lines that continue its help."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = [line]
        elif current is not None and line.startswith(" " * 8) and line.strip():
            blocks[current].append(line)
        else:
            current = None
    return blocks


def _help_lines(block: list[str]) -> int:
    """Lines of help text in an option's block: the invocation line counts when the help
    starts on it (after a run of two or more spaces)."""
    first_has_help = re.match(r"^  \S.*?\S {2,}\S", block[0]) is not None
    return len(block) - 1 + first_has_help


def _check_rendering(parser: argparse.ArgumentParser, actions) -> dict[str, list[str]]:
    """Every option is shown, with at most MAX_HELP_LINES lines of help, "default" at most
    once, no line wider than COLUMNS, and no flag name broken at a hyphen."""
    blocks = _blocks(parser.format_help())
    for action in actions:
        flag = action.option_strings[0]
        block = blocks[flag]
        for line in block:
            assert len(line) <= COLUMNS, line
            assert not line.endswith("-"), f"a flag name broken at a hyphen: {line!r}"
        shown = " ".join(" ".join(block).split())
        assert _help_lines(block) <= MAX_HELP_LINES, "\n".join(block)
        assert shown.lower().count("default") <= 1, shown
        assert "(default: None)" not in shown and "(default: False)" not in shown, shown
    return blocks


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings]


def test_every_flag_has_a_short_help_and_its_default_once():
    parser = build_parser()
    actions = _options(parser)
    assert len(actions) > 100
    for action in actions:
        assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), \
            f"{action.option_strings[0]} has no help"
        assert "\n" not in action.help
    blocks = _check_rendering(parser, actions)
    # the formatter's rule, seen on the real flags
    assert "(default: 4)" in " ".join(blocks["--num-layers"])
    assert "(default: 0.0)" in " ".join(blocks["--min-lr"])        # a falsy default shows
    assert " ".join(blocks["--ffn-hidden-size"]).count("default") == 1   # said in the help
    assert "default" not in " ".join(blocks["--save"])               # None: nothing to show
    assert "default" not in " ".join(blocks["--bf16"])               # a switch


def test_help_stays_short_and_links_the_docs():
    text = build_parser().format_help()
    lines = text.splitlines()
    assert len(lines) <= MAX_TOTAL_LINES, f"--help is {len(lines)} lines"
    assert max(len(line) for line in lines) <= COLUMNS
    assert "docs/usage.md explains each flag" in text
    assert lines[0] == "usage: pretrain_gpt.py [-h] [FLAG ...]"


def test_formatter_appends_a_default_only_where_the_help_has_none():
    p = argparse.ArgumentParser(formatter_class=OneLineHelpFormatter)
    p.add_argument("--count", type=int, default=3, help="how many")
    p.add_argument("--zero", type=int, default=0, help="falsy but real")
    p.add_argument("--derived", type=int, default=None, help="size (default: 2 x --count)")
    p.add_argument("--literal", type=int, default=5, help="five (default: %(default)s)")
    p.add_argument("--path", default=None, help="where")
    p.add_argument("--switch", action="store_true", help="on")
    p.add_argument("--off", action="store_false", dest="on", help="off")
    blocks = {flag: " ".join(" ".join(lines).split())
              for flag, lines in _blocks(p.format_help()).items()}
    assert blocks["--count"].endswith("how many (default: 3)")
    assert blocks["--zero"].endswith("falsy but real (default: 0)")
    assert blocks["--derived"].endswith("size (default: 2 x --count)")
    assert blocks["--literal"].endswith("five (default: 5)")
    assert blocks["--path"].endswith("where")
    assert blocks["--switch"].endswith("on") and blocks["--off"].endswith("off")


def test_snake_flags_read_well_in_megatron_lms_parser():
    """Megatron-LM's parser uses argparse's plain formatter: each --snake-* flag with a
    default says it in its help, once, in at most two lines."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    add_snake_args(p)
    actions = [a for a in _options(p) if a.option_strings[0].startswith("--snake")]
    assert len(actions) >= 28
    _check_rendering(p, actions)
    for action in actions:
        if action.nargs != 0 and action.default is not None:
            assert "default" in action.help, action.option_strings[0]


def test_tokenizer_flags_read_well_in_a_plain_parser():
    """tools/preprocess_data.py adds the tokenizer flags to a plain parser too."""
    p = argparse.ArgumentParser(prog="preprocess_data.py")
    add_tokenizer_args(p.add_argument_group("tokenizer"))
    actions = [a for a in _options(p) if a.option_strings[0] != "-h"]
    _check_rendering(p, actions)
    assert "(default: ByteTokenizer)" in p.format_help()
