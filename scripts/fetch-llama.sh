#!/usr/bin/env bash
# Fetch the pinned llama.cpp tree (vendor/llama.cpp.pin) from its PyPI source
# distribution, verify the archive's size and sha256, and extract only
# vendor/llama.cpp into the git-ignored vendor/llama.cpp/. Idempotent: a tree
# already extracted from the same pin is left alone. Needs python3 with pip.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pin="$root/vendor/llama.cpp.pin"
dest="$root/vendor/llama.cpp"
cache="${SDQ_SDIST_CACHE:-$root/vendor/.cache}"

field() { sed -n "s/^$1 *= *//p" "$pin"; }
package=$(field package); version=$(field version)
sha256=$(field sha256); size=$(field size)
sdist="${package//-/_}-$version.tar.gz"

if [ -f "$dest/.sdq-pin" ] && cmp -s "$pin" "$dest/.sdq-pin"; then
    echo "fetch-llama: $dest already holds $package==$version"
    exit 0
fi

mkdir -p "$cache"
verify() {
    [ -f "$1" ] || return 1
    local got_size got_sha
    got_size=$(stat -c %s "$1")
    got_sha=$(sha256sum "$1" | cut -d' ' -f1)
    if [ "$got_size" != "$size" ] || [ "$got_sha" != "$sha256" ]; then
        echo "fetch-llama: $1: expected $size bytes sha256 $sha256, got $got_size bytes sha256 $got_sha" >&2
        return 1
    fi
}

if ! verify "$cache/$sdist" 2>/dev/null; then
    rm -f "$cache/$sdist"
    echo "fetch-llama: downloading $package==$version (source distribution, ~73 MiB)"
    # --no-binary for this one package only: ':all:' would build cmake from source.
    if ! python3 -m pip download --quiet --no-deps --no-binary "$package" \
            "$package==$version" -d "$cache" 2>"$cache/pip.log"; then
        echo "fetch-llama: 'pip download $package==$version' failed (log: $cache/pip.log)" >&2
        exit 1
    fi
    verify "$cache/$sdist" || { echo "fetch-llama: checksum mismatch, refusing $cache/$sdist" >&2; exit 1; }
fi

tmp=$(mktemp -d "$root/vendor/.extract.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$cache/$sdist" -C "$tmp" "${sdist%.tar.gz}/vendor/llama.cpp"
tree="$tmp/${sdist%.tar.gz}/vendor/llama.cpp"
# The sdist's tree carries a dangling git submodule pointer; through it cmake's
# build-info step makes ninja loop ("build.ninja still dirty"). The commit is
# passed to cmake by build.rs instead.
rm -f "$tree/.git"
cp "$pin" "$tree/.sdq-pin"
rm -rf "$dest"
mv "$tree" "$dest"
echo "fetch-llama: extracted $package==$version (llama.cpp $(field commit)) into $dest"
