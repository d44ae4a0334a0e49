#!/usr/bin/env bash
# Docker for the rollout tests, from nothing: Debian's docker.io and debootstrap, a daemon started
# in the background (no systemd), and the small base image the tests run tasks in, built from a
# debootstrap root with `docker import` (no image registry is reachable). Each step is skipped when
# it is already done; the root filesystem is cached as a tarball under ~/.cache/polar-mitm/images.
set -euo pipefail
IMAGE="${POLAR_MITM_TEST_IMAGE:-polar-mitm/rollout-base:bookworm}"
CACHE="${POLAR_MITM_CACHE:-$HOME/.cache/polar-mitm}/images"
PACKAGES="ca-certificates,libstdc++6,git,python3,python3-pytest,procps"
say() { echo "docker.sh: $*" >&2; }

if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  say "installing docker.io and debootstrap from Debian's packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd in the background (log: /tmp/polar-mitm-dockerd.log)"
  nohup dockerd >/tmp/polar-mitm-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start; see /tmp/polar-mitm-dockerd.log"; exit 1; }
fi

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  mkdir -p "$CACHE"
  tarball="$CACHE/bookworm-minbase.tar"
  if [ ! -s "$tarball" ]; then
    root=$(mktemp -d)
    say "debootstrap bookworm into $root (about a minute)"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" http://deb.debian.org/debian >/dev/null
    tar -C "$root" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
    rm -rf "$root"
  fi
  say "docker import $tarball as $IMAGE"
  docker import "$tarball" "$IMAGE" >/dev/null
fi
say "ready: $(docker image inspect "$IMAGE" --format '{{.Id}}' | cut -c1-19) $IMAGE"
