"""`make image-check`: build the images we ship and start them the way the operator's pod spec runs them.

No Docker engine and no registry are needed: buildah builds from the Dockerfiles in images/ (chroot
isolation, vfs storage, so `buildah images` lists the results) on a Debian bookworm base made with
debootstrap (cached in buildah's storage between runs). Each entrypoint then runs from its image's root
filesystem through unshare + chroot: the image's user, environment and working directory, the root
read-only, a fresh tmpfs on /tmp as the only writable place, and a network namespace with nothing but
loopback; the checks run inside that namespace (nsenter).

Steps: tools; the base image and the wheels (this host's pip configuration, images/fetch_wheels.py), side by
side; the engine image (CPU flavour) and the operator image, side by side; then the engine answers /health and
a chat completion through the official `openai` client, /metrics names a prebuilt kernel variant and nothing
was compiled at run time; Triton's own run-time C build (the path of its GPU driver module) works inside the
engine image; the operator reconciles a sample InferenceDeployment into its StatefulSet on the test kit's
Kubernetes emulator. Prints each step's time and the image sizes. Needs root (buildah's storage, namespaces).

`--gpu` (`make image-gpu`) builds the GPU engine image instead, the same way (torch 2.13.0 and its CUDA 13
libraries from PyPI, about 2.6 GB of wheels), and checks it without a GPU: torch is the CUDA 13.0 build and
lists the architectures the planner counts on, the NVIDIA container variables are set, Triton builds its
real driver module (triton/backends/nvidia/driver.c, linked against a stand-in libcuda.so.1) inside the image,
`pagoda kernels warm` for a catalogue GPU and model finds every variant already in the image's cache, and
`pagoda serve --dry-run --gpu NVIDIA-L4` (the entrypoint as far as it goes without a GPU) passes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "images"))
import fetch_wheels  # noqa: E402

STORAGE_CONF = Path("/etc/containers/storage.conf")
BASE = "localhost/pagoda-base:bookworm"
# bump when the recipe below changes: a cached base of another recipe is rebuilt
BASE_RECIPE = (
    "debootstrap minbase bookworm, apt sources bookworm + updates + security, apt caches emptied, v1"
)
MIRROR = "http://deb.debian.org/debian"
ENV = dict(os.environ, STORAGE_DRIVER="vfs")
TIMINGS: list[tuple[str, float]] = []
# images a tag named before this run rebuilt it: removed once built, so none is left dangling
REPLACED: list[str] = []
# working containers (ours, and those `buildah bud` names after the base): a run removes what an interrupted one left
CONTAINER_PREFIXES = ("pagoda-image-check-", "pagoda-base-working-container")


def say(msg: str) -> None:
    print(f"image-check: {msg}", flush=True)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    say(f"--- {name}")
    start = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - start
        TIMINGS.append((name, seconds))
        say(f"--- {name}: {seconds:.0f} s")


def side_by_side(tasks: dict[str, Callable[[], None]]) -> None:
    """Run ``tasks`` at once, each a step of its own: a download or a single-threaded pip install leaves the
    second core and the disk idle. The first failure is raised once all have ended."""

    def timed(name: str, task: Callable[[], None]) -> None:
        with step(name):
            task()

    with ThreadPoolExecutor(len(tasks)) as pool:
        futures = [pool.submit(timed, name, task) for name, task in tasks.items()]
    for future in futures:
        future.result()


def buildah(*args: str) -> list[str]:
    """A buildah command on the vfs storage (buildah 1.28, Debian bookworm's, ignores STORAGE_DRIVER)."""
    return ["buildah", "--storage-driver", "vfs", *args]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", ENV)
    return subprocess.run(cmd, check=True, **kw)


def output(cmd: list[str]) -> str:
    return run(cmd, capture_output=True, text=True).stdout.strip()


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# ---- building ------------------------------------------------------------------------------------------


TOOLS = {"buildah": "buildah", "debootstrap": "debootstrap", "ip": "iproute2"}  # command -> Debian package


def tools() -> None:
    missing = [package for command, package in TOOLS.items() if shutil.which(command) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise SystemExit(f"{', '.join(missing)} missing and no apt-get to install them")
        say(f"installing {', '.join(missing)} (Debian packages)")
        apt = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=apt)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=apt)


def storage_conf() -> None:
    """Make vfs buildah's default driver where nothing else is configured, so `buildah images` lists the images."""
    if not STORAGE_CONF.exists():
        STORAGE_CONF.parent.mkdir(parents=True, exist_ok=True)
        STORAGE_CONF.write_text(
            '# written by pagoda make image-check\n[storage]\ndriver = "vfs"\n'
            'runroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n'
        )
        say(f"wrote {STORAGE_CONF}: vfs is buildah's default storage driver")


def remove_leftover_containers() -> None:
    for line in output(buildah("containers", "--noheading", "--format", "{{.ContainerName}}")).splitlines():
        if line.startswith(CONTAINER_PREFIXES):
            subprocess.run(buildah("umount", line), capture_output=True, env=ENV)
            run(buildah("rm", line), stdout=subprocess.DEVNULL)


def image_id(name: str) -> str | None:
    proc = subprocess.run(
        buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", name),
        capture_output=True, text=True, env=ENV,
    )  # fmt: skip
    return proc.stdout.strip() if proc.returncode == 0 else None


def base_image() -> None:
    """Debian bookworm from Debian's own packages, as buildah's local image BASE (kept between runs)."""
    previous = image_id(BASE)
    if previous:
        labels = json.loads(output(buildah("inspect", "--type", "image", BASE)))["OCIv1"]["config"]
        if (labels.get("Labels") or {}).get("pagoda.base.recipe") == BASE_RECIPE:
            say(f"{BASE} is cached")
            return
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="pagoda-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], stdout=subprocess.DEVNULL)
        (rootfs / "etc/apt/sources.list").write_text(
            f"deb {MIRROR} bookworm main\ndeb {MIRROR} bookworm-updates main\n"
            "deb http://deb.debian.org/debian-security bookworm-security main\n"
        )
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        ctr = output(buildah("from", "--name", f"{CONTAINER_PREFIXES[0]}base", "scratch"))
        try:
            mnt = output(buildah("mount", ctr))
            run(["cp", "-a", f"{rootfs}/.", mnt])
            run(buildah("umount", ctr), stdout=subprocess.DEVNULL)
            run([*buildah("config"), "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--label", f"pagoda.base.recipe={BASE_RECIPE}", "--cmd", "bash", ctr])  # fmt: skip
            run(buildah("commit", "--quiet", ctr, BASE), stdout=subprocess.DEVNULL)
        finally:
            subprocess.run(buildah("rm", ctr), capture_output=True, env=ENV)
    if previous:
        REPLACED.append(previous)


def wheels(flavour: str = "cpu") -> None:
    """Every wheel the flavour's images install, downloaded into images/wheels/<flavour> (emptied first: the
    builds install from it with --no-index, so nothing stale may linger)."""
    shutil.rmtree(fetch_wheels.flavour_dir(flavour), ignore_errors=True)
    fetch_wheels.download(flavour)


def build(dockerfile: str, tag: str, args: dict[str, str]) -> None:
    """One layer per image (--layers=false: vfs stores every layer as a full copy). Output lines carry the
    image's name and the seconds since its build started. The tag's previous image is removed first: vfs keeps
    it whole, and beside the working container and the copy a commit makes (the GPU image: 6 GB each) it is
    what ran a CI machine out of disk."""
    previous = image_id(tag)
    if previous and subprocess.run(buildah("rmi", tag), capture_output=True, env=ENV).returncode == 0:
        say(f"removed the previous {tag} ({previous[:12]}) before building it again")
        previous = None
    say(f"free disk for buildah's storage: {free_gib():.1f} GiB")
    cmd = buildah("bud", "--isolation", "chroot", "--layers=false", "-f", dockerfile, "-t", tag)
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    label, start = tag.rsplit("/", 1)[-1], time.monotonic()
    with subprocess.Popen([*cmd, str(ROOT)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc:  # fmt: skip
        for line in proc.stdout:
            print(f"[{label} {time.monotonic() - start:4.0f} s] {line}", end="", flush=True)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    if previous and previous != image_id(tag):
        REPLACED.append(previous)


def free_gib() -> float:
    graphroot = output(buildah("info", "--format", "{{.store.GraphRoot}}"))
    return shutil.disk_usage(graphroot).free / 2**30


def remove_replaced() -> None:
    """The images this run's tags replaced, the base last (the old images built on it go first)."""
    for image in reversed(REPLACED):
        proc = subprocess.run(buildah("rmi", image), capture_output=True, text=True, env=ENV)
        if proc.returncode:
            say(f"could not remove the replaced image {image}: {proc.stderr.strip()}")


def image_rootfs(image: str) -> str:
    """The image's root filesystem in buildah's vfs storage. vfs keeps every layer as a whole tree, so the top
    layer's directory is the image's root: mounted read-only, it spares the 2 GB copy a container would make."""
    graphroot = output(buildah("info", "--format", "{{.store.GraphRoot}}"))
    wanted = image_id(image)
    images = json.loads(Path(graphroot, "vfs-images", "images.json").read_text())
    layer = next(entry["layer"] for entry in images if entry["id"] == wanted)
    return str(Path(graphroot, "vfs", "dir", layer))


# ---- running an image like its pod ---------------------------------------------------------------------


class Sandbox:
    """An image's root filesystem (read-only, straight from buildah's storage) and a network namespace holding
    only loopback."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.config = json.loads(output(buildah("inspect", "--type", "image", image)))["OCIv1"]["config"]
        self.rootfs = image_rootfs(image)
        self.netns = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && exec sleep 86400"]
        )
        self.net = f"/proc/{self.netns.pid}/ns/net"
        deadline = time.monotonic() + 10
        while self._lo_down() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _lo_down(self) -> bool:
        proc = subprocess.run(["nsenter", f"--net={self.net}", "ip", "-o", "link", "show", "lo"],
                              capture_output=True, text=True)  # fmt: skip
        return "UP" not in proc.stdout.split(">")[0]

    def command(
        self, argv: list[str], env: dict[str, str] | None = None, files: dict[str, Path] | None = None
    ) -> list[str]:
        """The host command that runs ``argv`` in the image as its pod would (``files`` copied into /tmp)."""
        user = self.config.get("User") or "0:0"
        uid, _, gid = user.partition(":")
        assert uid not in ("", "0", "root"), f"{self.image} runs as root ({user!r})"
        environ = dict(e.split("=", 1) for e in self.config.get("Env") or [])
        environ.update(env or {})
        setup = [
            "set -e",
            'R="$1"',
            "mount --make-rprivate /",
            'mount --bind "$R" "$R"',
            'mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/tmp"',
            'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
            'mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"',
            'mount -t tmpfs -o mode=755,nosuid tmpfs "$R/dev"',
            'for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done',
            'mkdir "$R/dev/shm" && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"',
            *(f'cp {shlex.quote(str(src))} "$R/tmp/{name}"; chmod 0444 "$R/tmp/{name}"' for name, src in (files or {}).items()),
            'mount -o remount,bind,ro "$R"',
            'shift',
            'exec chroot --userspec="$UID_GID" --groups="$GID" "$R" /usr/bin/env -i "$@"',
        ]  # fmt: skip
        workdir = self.config.get("WorkingDir") or "/"
        inner = [f"{k}={v}" for k, v in environ.items()] + [
            "/bin/sh",
            "-c",
            f'cd {shlex.quote(workdir)} && exec "$@"',
            "sh",
            *argv,
        ]
        return [
            "nsenter", f"--net={self.net}", "--",
            "unshare", "--mount", "--pid", "--fork", "--kill-child", "--",
            "env", f"UID_GID={uid}:{gid or uid}", f"GID={gid or uid}",
            "sh", "-c", "\n".join(setup), "sandbox", self.rootfs, *inner,
        ]  # fmt: skip

    def entrypoint(self, cmd_overrides: dict[str, str] | None = None, extra: list[str] = ()) -> list[str]:
        args = list(self.config.get("Cmd") or [])
        for i, arg in enumerate(args[:-1]):
            if cmd_overrides and arg in cmd_overrides:
                args[i + 1] = cmd_overrides[arg]
        return [*(self.config.get("Entrypoint") or []), *args, *extra]

    def in_netns(self, argv: list[str]) -> list[str]:
        """A host command that runs in this sandbox's network namespace (the checks' clients)."""
        return ["nsenter", f"--net={self.net}", "--", *argv]

    def close(self) -> None:
        self.netns.kill()
        self.netns.wait()


@contextlib.contextmanager
def sandbox(image: str) -> Iterator[Sandbox]:
    box = Sandbox(image)
    try:
        yield box
    finally:
        box.close()


@contextlib.contextmanager
def started(cmd: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the process group (unshare ignores it, the sandboxed process is in the same group), then
    SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def client(box: Sandbox, role: str, *args: str, timeout: float = 900) -> None:
    """Run this script's client ``role`` inside the sandbox's network namespace, with this venv's Python."""
    cmd = box.in_netns([sys.executable, __file__, "--client", role, *args])
    subprocess.run(cmd, check=True, timeout=timeout)


# ---- the checks -----------------------------------------------------------------------------------------

ENGINE_PORT = 8000
TRITON_CHECK = r"""
import errno, os, socket
# the sandbox is what the pod spec promises: not root, read-only root, /tmp writable, no network but loopback
assert os.getuid() != 0 and os.getgid() != 0, (os.getuid(), os.getgid())
try:
    open("/opt/pagoda/written", "w")
    raise AssertionError("the root filesystem is writable")
except OSError as exc:
    assert exc.errno == errno.EROFS, exc
open("/tmp/written", "w").close()
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3)
    raise AssertionError("the network reaches beyond loopback")
except OSError as exc:
    assert exc.errno == errno.ENETUNREACH, exc
import triton.runtime.build as build
src = '''
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagoda_triton_check", NULL, -1, methods};
PyMODINIT_FUNC PyInit_pagoda_triton_check(void) { return PyModule_Create(&module); }
'''
mod = build.compile_module_from_src(src, "pagoda_triton_check")
assert mod.answer() == 42, mod.answer()
import os, triton
print("triton", triton.__version__, "built and loaded a C module under", os.environ["TRITON_CACHE_DIR"])
"""


def check_engine(box: Sandbox, logs: Path) -> None:
    cmd = box.entrypoint(
        {"--host": "127.0.0.1", "--port": str(ENGINE_PORT)},
        ["--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024"],
    )
    log = logs / "engine.log"
    with started(box.command(cmd), log) as proc:
        try:
            client(box, "engine", str(ENGINE_PORT))
        except subprocess.CalledProcessError:
            say(f"engine log:\n{log.read_text()[-6000:]}")
            raise
        assert proc.poll() is None, f"the engine exited: {log.read_text()[-4000:]}"
        # what a run-time build would leave on the pod's only writable place
        built = subprocess.run(
            ["nsenter", f"--mount=/proc/{proc.pid}/ns/mnt", "--", "find", f"{box.rootfs}/tmp", "-name", "*.so",
             "-o", "-name", "cpu-kernels"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert not built, f"built at run time: {built}"
    text = log.read_text()
    loaded = [line.strip() for line in text.splitlines() if "CPU kernels:" in line]
    assert loaded and "(prebuilt" in loaded[0], text[-4000:]
    say("engine: " + loaded[0])


def check_triton_build(box: Sandbox, logs: Path) -> None:
    with started(box.command(["python", "-c", TRITON_CHECK]), logs / "triton.log") as proc:
        rc = proc.wait(600)
    out = (logs / "triton.log").read_text()
    assert rc == 0, out[-4000:]
    say(out.strip().splitlines()[-1])


GPU_CHECK = r"""
import glob, json, os, subprocess, sys, sysconfig, tempfile
import torch
env = {k: os.environ.get(k) for k in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA",
                                      "LD_LIBRARY_PATH", "PAGODA_KERNEL_CACHE")}
archs = sorted(a for a in torch._C._cuda_getArchFlags().split() if a.startswith("sm_"))
import triton
from triton.backends.nvidia import driver as nv
from triton.runtime.build import _build
# Triton's driver module, as its first launch builds it, linked against a stand-in libcuda.so.1 (no GPU here)
stub = tempfile.mkdtemp()
subprocess.run(["gcc", "-shared", "-fPIC", "-x", "c", "/dev/null", "-o", f"{stub}/libcuda.so.1"], check=True)
src = open(os.path.join(os.path.dirname(nv.__file__), "driver.c")).read()
built = tempfile.mkdtemp()
with open(f"{built}/cuda_utils.c", "w") as f:
    f.write(src)
so = _build("cuda_utils", f"{built}/cuda_utils.c", built, [nv.libdevice_dir, stub], nv.include_dirs, nv.libraries, [])
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "archs": archs, "triton": triton.__version__,
                  "driver_module": os.path.basename(so), "seed_entries": len(os.listdir(env["PAGODA_KERNEL_CACHE"])),
                  "env": env}))
"""


def check_gpu_image(box: Sandbox, logs: Path) -> dict:
    """Inside the GPU image, as its pod runs (no GPU): torch's build, the container toolkit's variables, Triton's
    driver-module build, and `pagoda kernels warm` for a catalogue GPU and model compiling nothing new."""
    from pagoda.engine.sizing.gpus import ENGINE_CUDA, TORCH_WHEEL_ARCHS

    with started(box.command(["python", "-c", GPU_CHECK]), logs / "gpu.log") as proc:
        rc = proc.wait(600)
    out = (logs / "gpu.log").read_text()
    assert rc == 0, out[-4000:]
    facts = json.loads(out.strip().splitlines()[-1])
    say(f"gpu image: {json.dumps(facts)}")
    assert facts["cuda"] == ENGINE_CUDA and facts["torch"].endswith("+cu" + ENGINE_CUDA.replace(".", "")), (
        facts
    )
    assert sorted(facts["archs"]) == sorted(f"sm_{a}{b}" for a, b in TORCH_WHEEL_ARCHS), facts
    env = facts["env"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_REQUIRE_CUDA"] == f"cuda>={ENGINE_CUDA}", (
        env
    )
    assert (
        "compute" in env["NVIDIA_DRIVER_CAPABILITIES"] and "/usr/local/nvidia/lib64" in env["LD_LIBRARY_PATH"]
    )
    assert facts["seed_entries"] > 0, facts
    # a catalogue GPU and model, warmed again into /tmp: every entry it makes is one the image already has
    warm = ["sh", "-c", "pagoda kernels warm --gpu L4 --model meta-llama/Llama-3.1-8B-Instruct --common --jobs 1 "
            "--cache-dir /tmp/warm > /dev/null 2> /tmp/warm.log || { cat /tmp/warm.log; exit 1; }; "
            "ls /tmp/warm && echo --- && ls \"$PAGODA_KERNEL_CACHE\""]  # fmt: skip
    with started(box.command(warm), logs / "warm.log") as proc:
        rc = proc.wait(1200)
    out = (logs / "warm.log").read_text()
    assert rc == 0, out[-4000:]
    lines = out.splitlines()
    fresh, seed = lines[: lines.index("---")], set(lines[lines.index("---") + 1 :])
    fresh = [e for e in fresh if re.fullmatch(r"[A-Z0-9]{40,}", e)]  # cache entries are named by their key
    missing = [e for e in fresh if e not in seed]
    assert fresh and not missing, f"{len(missing)} of {len(fresh)} L4 variants are not in the image's cache"
    say(
        f"gpu image: kernels warm --gpu L4 (Llama-3.1-8B, common variants): {len(fresh)} cache entries, all in the image's"
    )
    # the entrypoint's own start-up path as far as it goes without a GPU: serve's dry run for a catalogue GPU
    with started(
        box.command(["pagoda", "serve", "--dry-run", "--gpu", "NVIDIA-L4"]), logs / "dry-run.log"
    ) as proc:
        rc = proc.wait(600)
    out = (logs / "dry-run.log").read_text()
    assert rc == 0 and '"warnings"' in out, out[-4000:]
    say("gpu image: pagoda serve --dry-run --gpu NVIDIA-L4 passes")
    return facts


def check_operator(image: str, logs: Path) -> None:
    from pagoda_testkit import chart_operator_args

    with sandbox(image) as box, tempfile.TemporaryDirectory() as tmp:
        kubeconfig, ready, done = Path(tmp) / "kubeconfig", Path(tmp) / "ready", Path(tmp) / "done"
        emulator = subprocess.Popen(
            box.in_netns(
                [sys.executable, __file__, "--client", "emulator", str(kubeconfig), str(ready), str(done)]
            ),
            start_new_session=True,
        )
        try:
            wait_for(ready, emulator, 60, "the emulated cluster never started")
            args = chart_operator_args(metrics_port=8080, health_port=8081)
            env = {"KUBECONFIG": "/tmp/kubeconfig", "POD_ID": "pagoda-operator-image-check"}
            cmd = box.command(box.entrypoint(extra=args), env, {"kubeconfig": kubeconfig})
            with started(cmd, logs / "operator.log") as operator:
                try:
                    wait_for(
                        done, emulator, 300, "the operator did not reconcile the sample InferenceDeployment"
                    )
                except AssertionError:
                    say(f"operator log:\n{(logs / 'operator.log').read_text()[-6000:]}")
                    raise
                assert operator.poll() is None, "the operator exited"
        finally:
            stop(emulator, grace=5)


def wait_for(path: Path, helper: subprocess.Popen, timeout: float, what: str) -> None:
    """Until ``helper`` creates ``path``; fails when it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert helper.poll() is None and time.monotonic() < deadline, what
        time.sleep(0.2)


# ---- the clients, run inside a sandbox's network namespace --------------------------------------------


def engine_client(port: str) -> None:
    import httpx
    import openai

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "no /health within 600 s"
        time.sleep(0.5)
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = api.models.list().data[0].id
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and text, reply
    say(f"engine: chat completion from {model}: {text!r}")
    metrics = httpx.get(url + "/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("pagoda:cpu_kernels_info{")]
    assert info and 'origin="prebuilt"' in info[0] and 'variant="torch"' not in info[0], (
        info or metrics[-3000:]
    )
    say(f"engine: {info[0]}")


def emulator_client(kubeconfig: str, ready: str, done: str) -> None:
    """The test kit's Kubernetes emulator with a GPU node and a sample InferenceDeployment; creates ``done``
    once the operator has made its StatefulSet, then serves until stopped (the operator is stopped first)."""
    import pagoda_testkit as testkit
    import yaml

    sample = testkit.example("qwen2.5-7b-l4-fp8.yaml")

    async def populate(cluster) -> None:
        await cluster.add_node("gpu-l4-0", "l4")
        await cluster.create(sample)

    with testkit.ClusterThread(populate) as cluster:
        Path(kubeconfig).write_text(yaml.safe_dump(testkit.kubeconfig(cluster.url)))
        Path(ready).touch()
        name = sample["metadata"]["name"]
        while cluster.cluster.get(testkit.STS, "default", name) is None:
            time.sleep(0.2)
        say(f"operator: InferenceDeployment {name} -> StatefulSet {name}")
        Path(done).touch()
        while True:
            time.sleep(60)


# ---- main ------------------------------------------------------------------------------------------------


def sizes(images: list[str]) -> None:
    for image in images:
        size = json.loads(output(buildah("images", "--json", image)))[0]["size"]  # "2.24 GB": uncompressed
        say(f"size {image}: {size}")


CPU_ARGS = {"TORCH_FLAVOUR": "cpu", "NVIDIA_VISIBLE_DEVICES": "", "NVIDIA_REQUIRE_CUDA": ""}


def gpu_main(checks_only: bool = False) -> int:
    """`make image-gpu`: the GPU engine image, built and checked here without a GPU (``checks_only``: the
    checks of the image built before)."""
    engine = f"localhost/pagoda-engine:{version()}"
    logs = Path(tempfile.mkdtemp(prefix="pagoda-image-gpu-"))
    start = time.monotonic()
    if checks_only:
        return gpu_checks(engine, logs, start)
    with step("tools (buildah, debootstrap)"):
        tools()
        storage_conf()
        remove_leftover_containers()
    with step("base image and wheels"):
        side_by_side(
            {"base image (debootstrap bookworm)": base_image, "wheels cu130 (PyPI)": lambda: wheels("cu130")}
        )
    with step(f"build {engine}"):
        build(
            "images/engine/Dockerfile",
            engine,
            {"BASE_IMAGE": BASE, "VERSION": version(), "TORCH_FLAVOUR": "cu130"},
        )
    with step("remove the images this run replaced"):
        remove_replaced()
    return gpu_checks(engine, logs, start)


def gpu_checks(engine: str, logs: Path, start: float) -> int:
    with sandbox(engine) as box:
        with step("gpu image: torch, toolkit variables, Triton's driver module, warmed kernels"):
            check_gpu_image(box, logs)
        with step("engine: Triton's run-time C build"):
            check_triton_build(box, logs)
    sizes([engine])
    for name, seconds in TIMINGS:
        say(f"{seconds:6.0f} s  {name}")
    say(f"{time.monotonic() - start:6.0f} s  total (logs in {logs})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help="build and check the GPU engine image instead")
    parser.add_argument("--checks-only", action="store_true", help="with --gpu: check the image built before")
    args = parser.parse_args()
    if args.client:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        role, *rest = args.client
        {"engine": engine_client, "emulator": emulator_client}[role](*rest)
        return 0
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        raise SystemExit("image-check needs root on Linux (buildah's storage, mount and network namespaces)")
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    if args.gpu:
        return gpu_main(args.checks_only)
    engine, operator = f"localhost/pagoda-engine:{version()}-cpu", f"localhost/pagoda-operator:{version()}"
    logs = Path(tempfile.mkdtemp(prefix="pagoda-image-check-"))
    start = time.monotonic()
    with step("tools (buildah, debootstrap)"):
        tools()
        storage_conf()
        remove_leftover_containers()
    with step("base image and wheels"):
        side_by_side(
            {"base image (debootstrap bookworm)": base_image, "wheels (host pip configuration)": wheels}
        )
    common = {"BASE_IMAGE": BASE, "VERSION": version()}
    with step("both images"):
        side_by_side({
            f"build {engine}": lambda: build("images/engine/Dockerfile", engine, {**common, **CPU_ARGS}),
            f"build {operator}": lambda: build("images/operator/Dockerfile", operator, common),
        })  # fmt: skip
    with step("remove the images this run replaced"):
        remove_replaced()
    with sandbox(engine) as box:
        with step("engine: /health, chat completion, prebuilt kernels"):
            check_engine(box, logs)
        with step("engine: Triton's run-time C build"):
            check_triton_build(box, logs)
    with step("operator: InferenceDeployment -> StatefulSet"):
        check_operator(operator, logs)
    sizes([engine, operator])
    for name, seconds in TIMINGS:
        say(f"{seconds:6.0f} s  {name}")
    say(f"{time.monotonic() - start:6.0f} s  total (logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
