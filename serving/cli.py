"""What the command lines (serving.server, serving.demo, profiles.bench_serving) share: a parser whose errors are
one line on stderr (exit status 2, as argparse's), help that shows every default, and argument types that refuse
a nonsensical value at parse time, before anything is loaded."""
import argparse

from model.load import check_model_spec
from serving.config import MAX_SPECULATIVE_TOKENS, EngineConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (line breaks kept); each flag's help ends with its default, unless the default
    is None or False (nothing set) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line: `PROG: error: MESSAGE; see --help`, exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def model_spec(spec: str) -> str:
    """argparse type of --model: a preset name or a checkpoint folder (model.load.check_model_spec)."""
    try:
        check_model_spec(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return spec


def int_at_least(low: int, high: int | None = None):
    """argparse type: an integer in [low, high] (no upper bound when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
port = int_at_least(1, 65535)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1] (a share of a GPU's memory)."""
    value = _number(text)
    if not 0 < value <= 1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_state_cache_args(ap: argparse.ArgumentParser, cpu_slots: int | None = None) -> None:
    """--state-cache-fraction and --state-cache-gb: how much memory the GDN snapshot pool takes on a CUDA device
    (EngineConfig.state_cache_fraction, state_cache_gb); on the CPU the pool keeps a fixed slot count, which
    --snapshot-slots sets where cpu_slots gives its default."""
    ap.add_argument("--state-cache-fraction", type=fraction, default=EngineConfig.state_cache_fraction,
                    help="share of the memory left for the KV pool that the GDN snapshot pool (prefix cache) takes, "
                         "on a GPU, in (0, 1]")
    ap.add_argument("--state-cache-gb", type=positive_float, default=None,
                    help="GiB of the GDN snapshot pool on a GPU (overrides --state-cache-fraction)")
    if cpu_slots is not None:
        ap.add_argument("--snapshot-slots", type=non_negative_int, default=cpu_slots,
                        help="GDN snapshot slots of the prefix cache on the CPU (a GPU sizes them from memory)")


def add_speculative_args(ap: argparse.ArgumentParser) -> None:
    """--speculative-tokens, --speculative-draft-vocab: EngineConfig.speculative_tokens and draft_vocab_size."""
    ap.add_argument("--speculative-tokens", type=int_at_least(0, MAX_SPECULATIVE_TOKENS), default=0, metavar="K",
                    help="drafts of the model's MTP head that each decode step verifies, 0..4 (0: off; needs the "
                         "checkpoint's mtp.* weights, which presets have at random)")
    ap.add_argument("--speculative-draft-vocab", type=int_at_least(0), default=0, metavar="N",
                    help="with --speculative-tokens: draft among the first N token ids only (0: the full vocab); "
                         "a cheaper draft head, exact output")


def speculative_fields(args) -> dict:
    """The EngineConfig fields of add_speculative_args' flags (args: their parsed namespace or ServerArgs)."""
    return dict(speculative_tokens=args.speculative_tokens, draft_vocab_size=args.speculative_draft_vocab)


def check_speculative(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A draft vocab without drafts is a mistake on the command line: say so there (argparse's exit 2)."""
    if args.speculative_draft_vocab and not args.speculative_tokens:
        ap.error("argument --speculative-draft-vocab: needs --speculative-tokens K >= 1")


def prog(module: str) -> str:
    """How the command is run, for usage lines: `python -m MODULE`."""
    return f"python -m {module}"
