"""How data directories are named: `${paths.data_dir}/<recipe>/<model>/<name>`, where a local source's name says
which file it came from (the `source_name` resolver of `conf/data/local.yaml`)."""

import hashlib
from pathlib import Path


def source_name(source: str) -> str:
    """A data directory name for a conversation source: a file or directory gets its stem and a hash of its absolute
    path, so that different sources never share a directory; a name ('sharegpt', a hub dataset) is kept."""
    path = Path(str(source))
    if not path.exists():
        return str(source).replace("/", "--")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    return f"{path.stem}-{digest}"
