#!/bin/sh
# mmdebstrap's customize hook for kvprof's image (scripts/dev.sh image): run outside the image
# as root, its root file system in $1, apt still usable inside. Installs the wheel with its PyPI
# dependencies from the wheelhouse given (no network needed for them) into /opt/kvprof, a venv
# that sees the OS's site packages (python3-bpfcc), and Debian's generic kernel headers as one
# merged tree for hosts without their own (KVPROF_KERNEL_HEADERS, kvprof/system.py).
set -eu
r=$1
: "${KVPROF_WHEEL:?}" "${KVPROF_WHEELHOUSE:?}" "${KVPROF_KERNEL_HEADERS:?}"

mkdir -p "$r/tmp/dist"
cp "$KVPROF_WHEELHOUSE"/*.whl "$r/tmp/dist/"
[ -f "$r/tmp/dist/$(basename "$KVPROF_WHEEL")" ] || cp "$KVPROF_WHEEL" "$r/tmp/dist/"
chroot "$r" /usr/bin/python3 -m venv --system-site-packages /opt/kvprof
chroot "$r" /opt/kvprof/bin/pip install -q --no-index --no-cache-dir \
  --disable-pip-version-check --find-links /tmp/dist "/tmp/dist/$(basename "$KVPROF_WHEEL")"
# The bcc it finds is the OS's, and the command runs.
chroot "$r" /opt/kvprof/bin/python -c \
  'import kvprof.capture.bccload as b; b.load_bcc(); import kvprof.cli'

# Headers: the generic package's two halves (arch-specific and common), without what they
# depend on (the compiler that builds modules: bcc brings its own clang).
hdr=$(chroot "$r" apt-cache depends linux-headers-amd64 |
      sed -n 's/.*Depends: \(linux-headers-[0-9].*-amd64\)$/\1/p' | head -n 1)
[ -n "$hdr" ] || { echo "image-customize: no linux-headers-*-amd64 behind linux-headers-amd64" >&2; exit 1; }
mkdir -p "$r/tmp/debs" "$r/tmp/h"
chroot "$r" sh -c "cd /tmp/debs && apt-get download -q -o APT::Sandbox::User=root $hdr ${hdr%-amd64}-common" >/dev/null
for d in "$r"/tmp/debs/*.deb; do dpkg-deb -x "$d" "$r/tmp/h"; done
out="$r$KVPROF_KERNEL_HEADERS"
mkdir -p "$out"
cp -a "$r"/tmp/h/usr/src/linux-headers-*-common/. "$out/"
arch_tree=$(ls -d "$r"/tmp/h/usr/src/linux-headers-*-amd64)
cp -a "$arch_tree/include" "$arch_tree/arch" "$arch_tree/.config" "$out/"
test -f "$out/include/linux/kconfig.h"
test -f "$out/include/generated/autoconf.h"

rm -rf "$r/tmp/dist" "$r/tmp/debs" "$r/tmp/h"
mkdir -p "$r/var/lib/kvprof" "$r/run/kvprof"
# What mmdebstrap wrote for its own apt runs is not the image's.
rm -f "$r/etc/apt/apt.conf.d/99mmdebstrap"
