"""Checking a PolicyVersion's weight files against its sha256 manifest before anything is loaded: the checks live in
:mod:`rlstream.transport.manifest` (the learner verifies the serving version's weights with them too)."""
from rlstream.transport.manifest import (  # noqa: F401 - the inference side's names for the shared checks
    ManifestError, UntrustedVersion, UriOutsideRoots, FileNotInManifest, FileTypeNotAllowed, HardLinkRefused,
    VersionTooLarge, ALLOWED_UNLISTED, ALLOWED_SUFFIXES, ALLOWED_NAMES, DEFAULT_MAX_VERSION_BYTES, allowed_file,
    check_file_types, check_not_hard_linked, check_size, sha256_of, digest_files, local_dir, check_under_roots,
    check_only_listed, verify, stage, rollback_dir,
)
