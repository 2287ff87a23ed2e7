"""``python -m streams worker ...``: the stream worker without the rest of the CLI."""
from ops.cli_streams import streams_app

if __name__ == "__main__":
    streams_app()
