"""
Tests for nanochat/data/fetch/stores.py that need no server: the address forms it accepts and
refuses, paths and joins, the one-line error for a store whose package is missing (GCS, Azure, the
hub), the hashes each store's info dict states (computed here from real bytes), redaction of secrets
and the categories of store errors. Then GCS and the hub through a stand-in transport: an fsspec
memory filesystem whose info() answers in the store's own shape, read through stat, read_range,
list_names and download_file. The S3 paths run against a real S3 API in the tests that use the `s3`
fixture. Run:
    python -m pytest tests/data/fetch/test_stores.py -q
"""

import base64
import errno
import hashlib
import json
import sys
import threading
import zlib

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from conftest import write_shard
from nanochat.data.fetch import stores
from nanochat.data.fetch.address import join, path_in_store, redact, store_of
from nanochat.data.fetch.download import download_file
from nanochat.data.fetch.records import record_path
from nanochat.data.fetch.errors import MissingExtra, StoreError
from nanochat.data.fetch.stores import ObjectInfo

DATA = b"PAR1 not a real shard, but real bytes to hash" * 100


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: slow and obviously the definition."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_crc32c_is_the_standard_one():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of the CRC-32C catalogue


# -----------------------------------------------------------------------------
# A store's missing package: one line that names the pip install


@pytest.mark.parametrize("address, package, extra", [
    ("gs://bucket/prefix", "gcsfs", "gcs"), ("gcs://bucket/prefix", "gcsfs", "gcs"),
    ("az://container/prefix", "adlfs", "azure"),
    ("hf://datasets/owner/name/folder", "huggingface_hub", "hf")])
def test_a_missing_extra_is_one_line_with_the_pip_install(address, package, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # hidden: the import fails, as when absent
    stores.forget_filesystems()
    for call in (lambda: stores.filesystem(address, 5.0), lambda: stores.stat(address, 5.0),
                 lambda: stores.list_names(address, 5.0)):
        with pytest.raises(MissingExtra) as e:
            call()
        message = str(e.value)
        assert "\n" not in message
        assert f"pip install 'nanochat-data[{extra}]'" in message and package in message
    assert isinstance(e.value, ImportError)


# -----------------------------------------------------------------------------
# The hashes a store states, from its own info dict


def test_s3_hashes():
    md5 = hashlib.md5(DATA).hexdigest()
    crc = zlib.crc32(DATA)
    sha256 = hashlib.sha256(DATA).digest()
    single = {"ETag": f'"{md5}"', "ChecksumCRC32": b64(crc.to_bytes(4, "big")),
              "ChecksumSHA256": b64(sha256), "ChecksumType": "FULL_OBJECT"}
    assert stores.stated_hashes("s3", single) == {"md5": md5, "crc32": crc,
                                                  "sha256": sha256.hex()}
    # no ChecksumType: a full-object checksum, as before S3 stated the type
    assert stores.stated_hashes("s3", {"ETag": md5, "ChecksumCRC32C": b64(
        crc32c(DATA).to_bytes(4, "big"))}) == {"md5": md5, "crc32c": crc32c(DATA)}
    # multipart: the ETag is no md5 of the object, and COMPOSITE checksums are of its parts
    multipart = {"ETag": f'"{md5}-3"', "ChecksumCRC32": b64(crc.to_bytes(4, "big")) + "-3",
                 "ChecksumType": "COMPOSITE"}
    assert stores.stated_hashes("s3", multipart) == {}
    assert stores.stated_hashes("s3", {"ETag": f'"{md5}-3"'}) == {}
    # a composite checksum from a service that states no ChecksumType: not a whole-object CRC
    assert stores.stated_hashes("s3", {"ChecksumCRC32": b64(crc.to_bytes(4, "big")) + "-2"}) == {}
    # encrypted with KMS or a customer's key: the ETag is no md5, though it looks like one
    assert stores.stated_hashes("s3", {"ETag": f'"{md5}"', "ServerSideEncryption": "aws:kms"}) == {}
    assert stores.stated_hashes("s3", {"ETag": f'"{md5}"', "SSECustomerAlgorithm": "AES256"}) == {}
    assert stores.stated_hashes("s3", {"ETag": f'"{md5}"', "ServerSideEncryption": "AES256"}) == {
        "md5": md5}
    # S3's default checksum for new objects
    nvme = 0x1234_5678_9ABC_DEF0
    assert stores.stated_hashes("s3", {"ChecksumCRC64NVME": b64(nvme.to_bytes(8, "big"))}) == {
        "crc64nvme": nvme}


def test_gcs_azure_and_hub_hashes():
    md5 = hashlib.md5(DATA)
    gcs = {"md5Hash": b64(md5.digest()), "crc32c": b64(crc32c(DATA).to_bytes(4, "big"))}
    assert stores.stated_hashes("gcs", gcs) == {"md5": md5.hexdigest(), "crc32c": crc32c(DATA)}
    # a composite GCS object states a crc32c only
    assert stores.stated_hashes("gcs", {"crc32c": gcs["crc32c"]}) == {"crc32c": crc32c(DATA)}
    azure = {"content_settings": {"content_md5": bytearray(md5.digest())}}
    assert stores.stated_hashes("az", azure) == {"md5": md5.hexdigest()}
    assert stores.stated_hashes("abfs", azure) == {"md5": md5.hexdigest()}
    assert stores.stated_hashes("az", {"content_settings": {"content_md5": None}}) == {}
    sha256 = hashlib.sha256(DATA).hexdigest()
    assert stores.stated_hashes("hf", {"lfs": {"sha256": sha256, "size": len(DATA)}}) == {
        "sha256": sha256}
    assert stores.stated_hashes("hf", {"lfs": None, "blob_id": "abc"}) == {}  # not an LFS file
    assert stores.stated_hashes("file", {"size": 3, "mtime": 1.0}) == {}


# -----------------------------------------------------------------------------
# Errors: categories, retry or not, and never a secret


def test_redact_hides_secret_values(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-example-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_exampletoken123")
    monkeypatch.setenv("NANOCHAT_BUCKET_NAME", "public-bucket")  # not a secret's name
    text = "signed with wJalrXUtnFEMI-example-secret and hf_exampletoken123 in public-bucket"
    assert redact(text) == "signed with *** and *** in public-bucket"
    error = stores.store_error(ConnectionError("refused for wJalrXUtnFEMI-example-secret"),
                               "s3://public-bucket/p")
    assert "wJalrXUtnFEMI-example-secret" not in str(error) and "***" in str(error)
    # a setting of a secret-sounding name is no secret: "false" stays readable everywhere
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert redact("retry: false") == "retry: false"


class NoCredentialsError(Exception):
    """Named as botocore's is: store_error goes by the name."""


class FSTimeoutError(Exception):
    """Named as fsspec's is."""


@pytest.mark.parametrize("error, reason, retry", [
    (FileNotFoundError("b/p/x.parquet"), "not found", False),
    (PermissionError("403 Forbidden"), "access denied", False),
    (NoCredentialsError("Unable to locate credentials"), "no credentials", False),
    (OSError(errno.EBUSY, "busy"), "slow down", True),
    (OSError("An error occurred (SlowDown): Please reduce your request rate."), "slow down", True),
    (TimeoutError(), "timed out", True),
    (FSTimeoutError(), "timed out", True),
    (ConnectionResetError("reset by peer"), "connection failed", True)])
def test_store_error_categories(error, reason, retry):
    address = "s3://bucket/prefix/shard_00000.parquet"
    found = stores.store_error(error, address)
    assert isinstance(found, StoreError) and isinstance(found, OSError)
    assert (found.reason, found.retry) == (reason, retry)
    assert address in str(found) and "\n" not in str(found)
    if reason == "no credentials":
        assert "AWS_ACCESS_KEY_ID" in str(found)  # where S3's own tools look
    assert stores.store_error(found, "s3://other/x") is found  # already ours: unchanged


# -----------------------------------------------------------------------------
# GCS and the hub through a stand-in transport: a memory filesystem answering in their shapes


def _gcs_info(data: bytes) -> dict:
    return {"md5Hash": b64(hashlib.md5(data).digest()),
            "crc32c": b64(crc32c(data).to_bytes(4, "big")),
            # a number that changes when the bytes do, as GCS's generation changes on a rewrite
            "generation": str(int.from_bytes(hashlib.sha256(data).digest()[:6], "big"))}


def _hub_info(data: bytes) -> dict:
    git_blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return {"blob_id": git_blob, "lfs": {"sha256": hashlib.sha256(data).hexdigest(),
                                         "size": len(data), "pointer_size": 134}}


@pytest.fixture
def stand_ins(monkeypatch):
    """{"gcs": fs, "hf": fs}: memory filesystems (each with its own store) that stores.filesystem
    returns for gs:// and hf:// addresses; their info() adds the store's own fields."""
    made = {}
    for protocol, shape in (("gcs", _gcs_info), ("hf", _hub_info)):
        class StandIn(MemoryFileSystem):
            store, pseudo_dirs = {}, [""]  # this test's own objects, not the class-wide ones

            def info(self, path, shape=shape, **kwargs):
                info = super().info(path, **kwargs)
                if info["type"] == "file":
                    info |= shape(self.cat_file(path))
                return info

        made[protocol] = StandIn(skip_instance_cache=True)
    real = stores.filesystem

    def filesystem(address, timeout):
        protocol = store_of(address).protocol
        return made[protocol] if protocol in made else real(address, timeout)

    monkeypatch.setattr(stores, "filesystem", filesystem)
    return made


@pytest.mark.parametrize("protocol, base", [("gcs", "gs://bucket/data"),
                                            ("hf", "hf://datasets/owner/name/data")])
def test_stat_read_range_and_list_names_through_a_stand_in(stand_ins, protocol, base):
    fs = stand_ins[protocol]
    where = path_in_store(base)
    for name in ("b.parquet", "a.parquet", "notes.txt", "deeper/c.parquet", "text/notes.txt"):
        fs.pipe_file(f"{where}/{name}", DATA + name.encode())
    assert stores.list_names(base, 5.0) == ["a.parquet", "b.parquet"]

    data = DATA + b"a.parquet"
    address = join(base, "a.parquet")
    info = stores.stat(address, 5.0)
    if protocol == "gcs":
        expected = ObjectInfo(len(data), f"generation:{_gcs_info(data)['generation']}",
                              {"md5": hashlib.md5(data).hexdigest(), "crc32c": crc32c(data)})
    else:
        expected = ObjectInfo(len(data), f"blob_id:{_hub_info(data)['blob_id']}",
                              {"sha256": hashlib.sha256(data).hexdigest()})
    assert info == expected
    assert stores.read_range(address, 10, 50, 5.0) == data[10:50]
    assert stores.read_range(address, 0, len(data), 5.0) == data

    # a rewrite changes the version and the hashes
    fs.pipe_file(f"{where}/a.parquet", data + b"!")
    changed = stores.stat(address, 5.0)
    assert changed.version != info.version and changed.hashes != info.hashes

    with pytest.raises(StoreError) as e:
        stores.stat(join(base, "missing.parquet"), 5.0)
    assert e.value.reason == "not found" and not e.value.retry
    with pytest.raises(StoreError) as e:
        stores.stat(base, 5.0)  # a directory is no object
    assert e.value.reason == "not found"
    with pytest.raises(StoreError, match="holds no .parquet files") as e:
        stores.list_names(join(base, "text"), 5.0)
    assert e.value.reason == "not found"
    with pytest.raises(StoreError, match="not found in") as e:
        stores.list_names(join(base, "nowhere"), 5.0)
    assert e.value.reason == "not found"


@pytest.mark.parametrize("protocol, base, stated", [
    ("gcs", "gs://bucket/data", {"md5", "crc32c"}),
    ("hf", "hf://datasets/owner/name/data", {"sha256"})])
def test_download_file_through_a_stand_in(stand_ins, tmp_path, protocol, base, stated):
    shard = tmp_path / "shard_00000.parquet"
    write_shard(shard, [f"document {i} " * (i % 7 + 1) for i in range(200)], row_group_size=50)
    data = shard.read_bytes()
    stand_ins[protocol].pipe_file(f"{path_in_store(base)}/shard_00000.parquet", data)
    address = join(base, "shard_00000.parquet")
    assert set(stores.stat(address, 5.0).hashes) == stated

    path = tmp_path / "out" / "shard_00000.parquet"
    assert download_file(address, str(path)) == ""  # nothing was there before
    assert path.read_bytes() == data
    with open(record_path(str(path)), encoding="utf-8") as f:
        record = json.load(f)
    assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
    assert download_file(address, str(path)) is None  # already there and sound


def test_a_synchronous_client_that_never_answers_is_cut_at_the_bound(stand_ins, monkeypatch):
    # the hub's client is synchronous: its call is awaited on a thread, at most `within` seconds
    answer, answered = threading.Event(), threading.Event()
    fs = stand_ins["hf"]
    base = "hf://datasets/owner/name/data"
    fs.pipe_file(f"{path_in_store(base)}/a.parquet", DATA)
    real_info = type(fs).info

    def info(self, path, **kwargs):  # silent until the test lets it answer
        answer.wait(60)  # (without the bound, the call would return after these 60 s)
        answered.set()
        return real_info(self, path, **kwargs)

    monkeypatch.setattr(type(fs), "info", info)
    with pytest.raises(StoreError) as e:
        stores.stat(join(base, "a.parquet"), 5.0, within=0.3)
    assert e.value.reason == "timed out" and e.value.retry
    assert not answered.is_set()  # the call ended while the client was still silent
    answer.set()  # the thread left behind ends
    assert answered.wait(5)
    assert stores.stat(join(base, "a.parquet"), 5.0).size == len(DATA)
