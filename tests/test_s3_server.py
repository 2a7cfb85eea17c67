"""
The S3 test infrastructure itself (tests/s3_server.py, the s3 / s3_faulty fixtures): moto answers
and s3fs reads back exact bytes; the fault proxy forwards ranges exactly, sends SlowDown 503s,
cuts bodies short, and stops and starts on one port; the fixture's env never reads ~/.aws.

Run: python -m pytest tests/test_s3_server.py -q
"""

import hashlib
import http.client
import socket

import pytest
import requests

DATA = bytes(range(256)) * 1000  # 256,000 bytes: several of the proxy's 64 KiB chunks


def put_public(s3, key, data):
    """Upload readable without signing, for raw requests through the proxy (moto answers 403)."""
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=data, ACL="public-read")


def fresh_fs():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem()


@pytest.mark.slow
def test_s3fs_reads_back_uploaded_bytes_with_an_md5_etag(s3, tmp_path):
    (tmp_path / "up" / "sub").mkdir(parents=True)
    (tmp_path / "up" / "a.bin").write_bytes(DATA)
    (tmp_path / "up" / "sub" / "b.bin").write_bytes(b"bee")
    assert s3.upload_dir(tmp_path / "up", "data") == ["data/a.bin", "data/sub/b.bin"]
    s3.put("other/c.bin", b"see")
    assert s3.keys("data/") == ["data/a.bin", "data/sub/b.bin"]

    fs = fresh_fs()
    assert fs.cat_file(s3.url("data/a.bin")) == DATA
    assert fs.info(s3.url("data/a.bin"))["ETag"] == f'"{hashlib.md5(DATA).hexdigest()}"'
    assert sorted(fs.ls(s3.url("data"))) == [f"{s3.bucket}/data/a.bin", f"{s3.bucket}/data/sub"]
    s3.delete("other/c.bin")
    assert s3.keys() == ["data/a.bin", "data/sub/b.bin"]
    with pytest.raises(FileNotFoundError):
        fresh_fs().info(s3.url("other/c.bin"))


def test_a_ranged_read_through_the_proxy_is_exact(s3_faulty):
    s3_faulty.put("k.bin", DATA)
    fs = fresh_fs()
    assert fs.cat_file(s3_faulty.url("k.bin"), start=1000, end=200_000) == DATA[1000:200_000]
    ranged = [s for s in s3_faulty.proxy.seen() if s.range is not None]
    assert [(s.method, s.path, s.range) for s in ranged] == \
        [("GET", f"/{s3_faulty.bucket}/k.bin", "bytes=1000-199999")]
    assert s3_faulty.proxy.count("GET") == 1
    assert s3_faulty.proxy.count("PUT") == 0  # the upload went straight to the server


def test_slow_down_gives_503s_then_the_object(s3_faulty):
    put_public(s3_faulty, "k.bin", b"hello")
    s3_faulty.proxy.slow_down(2)
    url = f"{s3_faulty.proxy.endpoint}/{s3_faulty.bucket}/k.bin"
    for _ in range(2):
        r = requests.get(url, timeout=10)
        assert r.status_code == 503 and "Retry-After" not in r.headers
        assert b"<Code>SlowDown</Code>" in r.content
        assert b"<Message>Please reduce your request rate.</Message>" in r.content
    r = requests.get(url, timeout=10)
    assert (r.status_code, r.content) == (200, b"hello")
    assert s3_faulty.proxy.count("GET") == 3


def test_cut_after_sends_a_short_body_once(s3_faulty):
    put_public(s3_faulty, "k.bin", DATA)
    s3_faulty.proxy.cut_after(100_000)
    conn = http.client.HTTPConnection("127.0.0.1", s3_faulty.proxy.port, timeout=10)
    conn.request("GET", f"/{s3_faulty.bucket}/k.bin")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Length") == str(len(DATA))
    with pytest.raises(http.client.IncompleteRead) as cut:
        resp.read()
    assert cut.value.partial == DATA[:100_000]
    conn.close()
    r = requests.get(f"{s3_faulty.proxy.endpoint}/{s3_faulty.bucket}/k.bin", timeout=10)
    assert r.content == DATA  # the fault was for one response


def test_a_stopped_proxy_refuses_and_starts_again_on_its_port(s3_faulty):
    put_public(s3_faulty, "k.bin", b"hello")
    proxy = s3_faulty.proxy
    url = f"{proxy.endpoint}/{s3_faulty.bucket}/k.bin"
    session = requests.Session()  # a kept-alive connection is cut by stop()
    assert session.get(url, timeout=10).content == b"hello"
    port = proxy.port
    proxy.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    proxy.start()
    assert proxy.port == port
    assert session.get(url, timeout=10).content == b"hello"


def test_the_s3_fixture_env_does_not_read_the_home_aws_files(s3, tmp_path, monkeypatch):
    import botocore.session

    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(
        "[fromhome]\naws_access_key_id = FROMHOME\naws_secret_access_key = FROMHOME\n")
    (home / ".aws" / "config").write_text("[profile fromhome-config]\nregion = eu-west-3\n")
    monkeypatch.setenv("HOME", str(home))
    session = botocore.session.Session()
    assert session.available_profiles == []  # ~/.aws would add fromhome and fromhome-config
    assert session.get_credentials().access_key == "testing"
    s3.put("k.bin", b"hello")
    assert fresh_fs().cat_file(s3.url("k.bin")) == b"hello"
