"""deploy/uvflags.py: pip's settings handed to uv as flags, each value once."""

from __future__ import annotations

from shardps.deploy.uvflags import flags


def test_pips_settings_become_uvs_flags_each_value_once():
    listed = "\n".join([
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        ":env:.find-links='/opt/wheels'",
        ":env:.default-timeout='180'",
        "install.index-url='https://mirror.example/simple'",
    ])
    assert flags(listed) == ["--constraint", "/etc/xdg/pip/constraints.txt",
                             "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
                             "--find-links", "/opt/wheels", "--index-url", "https://mirror.example/simple"]
    assert flags("") == [] and flags("global.timeout='60'") == []
