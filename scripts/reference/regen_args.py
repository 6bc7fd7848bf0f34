"""The command line of the scripts that regenerate the repository's test data (make_golden.py,
make_hf_golden.py, tools/chat_template_fixtures.py): --out, and --help. Read before anything
heavy loads or is written: the scripts read no options, and any word (--help too) rewrote the
repository's files in place."""
import argparse


def parse_out(doc, default_out, what):
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", default=default_out, help=f"where {what} go (default: the repository's, %(default)s)")
    return parser.parse_args().out
