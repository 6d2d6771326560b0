"""`pagoda-model-download` for real: against a local server speaking the Hugging Face hub API (HF_ENDPOINT,
tests/support/pagoda_testkit/hfhub.py) and a local S3-compatible server (moto's server mode, with IAM keys
enforced). Each run is the real command in a subprocess, as the download Job runs it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pagoda.operator.download.progress import parse_progress
from pagoda.operator.download.result import EXIT_CODES
from pagoda_testkit.hfhub import FakeHub, Repo
from pagoda_testkit.processes import free_port

TOKEN, OTHER = "hf_granted_0123456789", "hf_not_granted_987654"
WEIGHTS = hashlib.sha256(b"seed").digest() * 9000  # 288 kB: an LFS file
FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS, "tokenizer.json": b"{}",
         "pytorch_model.bin": b"pickle" * 300}  # fmt: skip
DOWNLOAD = str(Path(sys.executable).parent / "pagoda-model-download")


def run(source: str, dest: Path, env: dict[str, str], *extra: str) -> tuple[int, dict, str]:
    """Run the download; (exit code, the termination log's JSON, stdout + stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_"))}
    term = dest.parent / f"{dest.name}-termination"
    proc = subprocess.run(
        [DOWNLOAD, "--source", source, "--dest", str(dest), "--termination-log", str(term), "--interval", "0.05",
         *extra],
        env={**base, "HF_HUB_DISABLE_TELEMETRY": "1", **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.returncode, json.loads(term.read_text()), proc.stdout + proc.stderr


ADAPTER = {"adapter_config.json": b'{"peft_type": "LORA", "r": 8, "lora_alpha": 16}',
           "adapter_model.safetensors": hashlib.sha256(b"lora").digest() * 2000, "adapter_model.bin": b"pickle"}  # fmt: skip


@pytest.fixture(scope="module")
def hub():
    repos = {"org/open": Repo(dict(FILES)), "org/gated": Repo(dict(FILES), gated=True),
             "org/lora": Repo(dict(ADAPTER))}  # fmt: skip
    with FakeHub(repos, {TOKEN: {"org/gated"}, OTHER: set()}) as server:
        yield server


def test_a_gated_file_needs_the_token_and_the_token_is_never_shown(hub, tmp_path) -> None:
    dest = tmp_path / "cache"
    env = {"HF_ENDPOINT": hub.url}
    for token, why in (
        (None, "no token was given"),
        (OTHER, "has no access"),
        ("hf_unknown_1234", "refused"),
    ):
        rc, result, out = run("hf://org/gated", dest, {**env, **({"HF_TOKEN": token} if token else {})})
        assert (rc, result["reason"]) == (EXIT_CODES["ModelAccessDenied"], "ModelAccessDenied"), out
        assert why in result["message"]
        assert token is None or token not in out + json.dumps(result)
    rc, result, out = run("hf://org/gated", dest, {**env, "HF_TOKEN": TOKEN})
    assert (rc, result["reason"]) == (0, "ModelReady"), out
    assert TOKEN not in out + json.dumps(result)
    # The token went to the hub (the gated file needed it) and nowhere else.
    assert ("GET", "/org/gated/resolve/" + hub.repos["org/gated"].revisions["main"] + "/model.safetensors",
            f"Bearer {TOKEN}") in hub.requests  # fmt: skip
    snapshot = Path(result["path"])
    assert (snapshot / "model.safetensors").read_bytes() == WEIGHTS
    assert not (snapshot / "pytorch_model.bin").exists()  # pickled weights are never fetched
    assert result["files"] == 3 and result["bytes"] == sum(
        len(v) for k, v in FILES.items() if k != "pytorch_model.bin"
    )


def test_the_engine_finds_the_download_where_it_looks(hub, tmp_path, monkeypatch) -> None:
    """The cache is laid out as the engine reads it offline: HF_HOME=<volume>/hf, `org/name` at a revision."""
    from pagoda.engine.loader.resolve import locate_model

    rc, result, out = run("hf://org/open", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert rc == 0, out
    monkeypatch.setenv("HF_HOME", str(tmp_path / "cache" / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert locate_model("org/open", "main") == Path(result["path"])


def test_adapters_come_beside_the_model_where_the_engine_finds_them(hub, tmp_path, monkeypatch) -> None:
    from pagoda.engine.loader.resolve import locate_adapter

    dest = tmp_path / "cache"
    rc, result, out = run("hf://org/open", dest, {"HF_ENDPOINT": hub.url}, "--adapter", "hf://org/lora@main")
    assert rc == 0, out
    assert result["files"] == 3 + 2  # the model's and the adapter's, never the pickled adapter_model.bin
    assert result["bytes"] == sum(len(v) for k, v in {**FILES, **ADAPTER}.items() if not k.endswith(".bin"))
    monkeypatch.setenv("HF_HOME", str(dest / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    found = locate_adapter("org/lora@main")
    assert (found / "adapter_model.safetensors").read_bytes() == ADAPTER["adapter_model.safetensors"]
    assert not (found / "adapter_model.bin").exists()


def test_progress_lines_and_a_second_run_fetches_nothing(hub, tmp_path) -> None:
    dest = tmp_path / "cache"
    rc, result, out = run("hf://org/open", dest, {"HF_ENDPOINT": hub.url})
    assert rc == 0, out
    last = parse_progress(out)
    assert last == {"bytes": result["bytes"], "totalBytes": result["bytes"], "files": 3, "totalFiles": 3}
    before = len(hub.requests)
    rc, again, out = run("hf://org/open", dest, {"HF_ENDPOINT": hub.url})
    assert rc == 0 and again["message"].startswith("already downloaded") and len(hub.requests) == before


def test_missing_repo_and_revision_are_not_found(hub, tmp_path) -> None:
    for source, words in (("hf://org/nothing", "does not exist"), ("hf://org/open@v9", "no revision 'v9'")):
        rc, result, _ = run(source, tmp_path / "cache", {"HF_ENDPOINT": hub.url})
        assert (rc, result["reason"]) == (EXIT_CODES["ModelNotFound"], "ModelNotFound") and words in result[
            "message"
        ]


def test_a_file_that_fails_its_hash_is_fetched_again_and_only_it(hub, tmp_path) -> None:
    """A weights file whose bytes do not match the hub's SHA-256 fails the run and is removed; the next run
    (the Job's retry) fetches that file alone: the files already complete are kept."""
    hub.repos["org/flaky"] = Repo(dict(FILES))
    hub.corrupt_once.add("org/flaky/model.safetensors")
    dest = tmp_path / "cache"
    rc, result, out = run("hf://org/flaky", dest, {"HF_ENDPOINT": hub.url})
    assert (rc, result["reason"]) == (1, "ModelDownloadFailed"), out
    assert "model.safetensors does not match its SHA-256" in result["message"]
    mark = len(hub.ranges)
    rc, result, out = run("hf://org/flaky", dest, {"HF_ENDPOINT": hub.url})
    assert rc == 0, out
    assert [name for name, _ in hub.ranges[mark:]] == ["org/flaky/model.safetensors"]
    assert (Path(result["path"]) / "model.safetensors").read_bytes() == WEIGHTS


# -- S3 ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server with IAM enforced after the first 3 calls (which make a user and its keys)."""
    import boto3
    import httpx

    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                proc.wait(0.1) if proc.poll() is not None else None
                import time

                time.sleep(0.1)
        root = {
            "endpoint_url": url,
            "region_name": "us-east-1",
            "aws_access_key_id": "root",
            "aws_secret_access_key": "root",
        }
        iam = boto3.client("iam", **root)
        iam.create_user(UserName="loader")
        key = iam.create_access_key(UserName="loader")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="loader", PolicyName="s3", PolicyDocument=json.dumps(policy))
        creds = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                 "AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1"}  # fmt: skip
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
        client.create_bucket(Bucket="models")
        for name, data in FILES.items():
            client.put_object(Bucket="models", Key=f"llama/tiny/{name}", Body=data)
        yield creds
    finally:
        proc.terminate()
        proc.wait(10)


def test_s3_download_with_keys_and_refusals(s3, tmp_path) -> None:
    dest = tmp_path / "cache"
    wrong = {**s3, "AWS_SECRET_ACCESS_KEY": "not-the-secret-key-0000"}
    rc, result, out = run("s3://models/llama/tiny", dest, wrong)
    assert (rc, result["reason"]) == (EXIT_CODES["ModelAccessDenied"], "ModelAccessDenied"), out
    assert "not-the-secret-key-0000" not in out + json.dumps(result)
    rc, result, out = run("s3://models/llama/nothing", dest, s3)
    assert (rc, result["reason"]) == (EXIT_CODES["ModelNotFound"], "ModelNotFound"), out
    rc, result, out = run("s3://no-such-bucket/x", dest, s3)
    assert result["reason"] == "ModelNotFound", out
    rc, result, out = run("s3://models/llama/tiny", dest, s3)
    assert (rc, result["reason"]) == (0, "ModelReady"), out
    assert s3["AWS_SECRET_ACCESS_KEY"] not in out + json.dumps(result)
    root = Path(result["path"])
    assert {p.name: p.read_bytes() for p in root.iterdir()} == FILES
    assert parse_progress(out)["bytes"] == sum(map(len, FILES.values()))


def test_s3_resumes_a_partial_file_and_refetches_a_corrupt_one(s3, tmp_path) -> None:
    dest = tmp_path / "cache"
    target = dest / "s3" / "models" / "llama" / "tiny" / "model.safetensors.partial"
    target.parent.mkdir(parents=True)
    target.write_bytes(WEIGHTS[:50_000])  # an earlier run stopped here
    rc, result, out = run("s3://models/llama/tiny", dest, s3)
    assert rc == 0, out
    assert (target.parent / "model.safetensors").read_bytes() == WEIGHTS
    # A partial file with wrong bytes fails its MD5, is removed, and the next try fetches it whole.
    dest2 = tmp_path / "cache2"
    bad = dest2 / "s3" / "models" / "llama" / "tiny" / "model.safetensors.partial"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\0" * 50_000)
    rc, result, out = run("s3://models/llama/tiny", dest2, s3)
    assert (rc, result["reason"]) == (1, "ModelDownloadFailed") and "MD5" in result["message"], out
    assert not bad.exists()
    rc, result, out = run("s3://models/llama/tiny", dest2, s3)
    assert rc == 0 and (bad.parent / "model.safetensors").read_bytes() == WEIGHTS


def test_a_full_volume_is_its_own_reason(s3, tmp_path) -> None:
    """Writes that the kernel refuses with ENOSPC (/dev/full) end as ModelVolumeFull."""
    dest = tmp_path / "cache"
    partial = dest / "s3" / "models" / "llama" / "tiny" / "model.safetensors.partial"
    partial.parent.mkdir(parents=True)
    partial.symlink_to("/dev/full")
    rc, result, out = run("s3://models/llama/tiny", dest, s3)
    assert (rc, result["reason"]) == (EXIT_CODES["ModelVolumeFull"], "ModelVolumeFull"), out
    assert "spec.model.cache.size" in result["message"]


def _put(s3: dict[str, str], objects: dict[str, bytes]) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=s3["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    for key, data in objects.items():
        client.put_object(Bucket="models", Key=key, Body=data)
    listed = {o["Key"] for o in client.list_objects_v2(Bucket="models")["Contents"]}
    assert set(objects) <= listed  # the store kept the keys as they are (no normalised path)


def _files_under(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "key",
    [
        "{tmp}/outside/abs",  # prefix//tmp/...: an absolute path once the prefix is cut off
        "../../escaped",  # out of the bucket's directory, onto another source's place in the cache
        "../../../../escaped",  # out of --dest
        "ok/../../../../../escaped",
    ],
)
def test_s3_keys_that_lead_out_of_the_cache_fail_the_download_and_write_nothing(s3, tmp_path, key) -> None:
    """A key under the prefix that is an absolute path (`prefix//abs/path`) or climbs with `..` fails the whole
    download with a reason naming it, before any object is fetched: nothing is written, inside --dest or
    outside it."""
    prefix = "evil-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    bad = f"{prefix}/{key.format(tmp=tmp_path)}"
    _put(s3, {f"{prefix}/config.json": FILES["config.json"], bad: b"not yours"})
    dest = tmp_path / "cache"
    rc, result, out = run(f"s3://models/{prefix}", dest, s3)
    assert (rc, result["reason"]) == (EXIT_CODES["ModelDownloadFailed"], "ModelDownloadFailed"), out
    assert f"object key s3://models/{bad} is refused" in result["message"], result["message"]
    assert "nothing was written" in result["message"]
    # Only the termination log exists: not the escaped file, not even the good object beside it.
    assert _files_under(tmp_path) == {"cache-termination"}, out
    assert not (tmp_path / "outside").exists() and not (tmp_path / "escaped").exists()


def test_s3_sources_with_dot_dot_are_refused_by_the_command_too(s3, tmp_path) -> None:
    """The CRD refuses `..` in a source; the command refuses it too (whatever started it), writing nothing."""
    dest = tmp_path / "cache"
    for source, words in (
        ("s3://models/llama/../../../x", "the prefix is refused: it has a '..' path part"),
        ("s3://../llama", "is not an S3 bucket name"),
    ):
        rc, result, out = run(source, dest, s3)
        assert (rc, result["reason"]) == (1, "ModelDownloadFailed"), out
        assert words in result["message"], result["message"]
    assert _files_under(tmp_path) == {"cache-termination"}


def test_hf_names_that_lead_out_of_the_cache_are_refused(hub, tmp_path) -> None:
    """A revision or repo that would become a path out of the Hugging Face cache (refs/REVISION,
    models--org--name) is refused before anything is written."""
    dest = tmp_path / "cache"
    for source, words in (
        ("hf://org/open@../../../../escaped", "the revision is refused: it has a '..' path part"),
        ("hf://org/..", "the repo is refused"),
    ):
        rc, result, out = run(source, dest, {"HF_ENDPOINT": hub.url})
        assert (rc, result["reason"]) == (1, "ModelDownloadFailed"), out
        assert words in result["message"], result["message"]
    assert _files_under(tmp_path) == {"cache-termination"}


@pytest.mark.parametrize("name", ["../../../../../../escaped", "sub//escaped", "{tmp}/escaped-abs"])
def test_hub_file_names_that_lead_out_of_the_snapshot_are_refused(hub, tmp_path, name) -> None:
    """A file the hub lists under a name that is no path inside the snapshot fails the download, naming it,
    before any file is fetched."""
    name = name.format(tmp=tmp_path)
    repo = "org/evil-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    hub.repos[repo] = Repo({"config.json": FILES["config.json"], name: b"not yours"})
    mark = len(hub.ranges)
    rc, result, out = run(f"hf://{repo}", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert (rc, result["reason"]) == (1, "ModelDownloadFailed"), out
    assert f"the file name {name!r} is refused" in result["message"], result["message"]
    assert hub.ranges[mark:] == []  # nothing was fetched
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))
    assert not (tmp_path / "escaped-abs").exists() and not (tmp_path / "escaped").exists()
