#!/usr/bin/env bash
# build.sh OUTDIR: libstdc++.so.6 (the shim, see shim.c) in OUTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$1
real=$(readlink -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6)
mkdir -p "$out"
nodes=$(readelf -V --wide "$real" | sed -n '/Version definition/,/Version needs/p' | grep -o "Name: [A-Z_0-9.]*" \
        | awk '{print $2}' | grep -v "^libstdc" | sort -u)
{
    for n in $nodes GLIBCXX_3.4.31; do echo "$n { };"; done
    echo "GLIBCXX_3.4.32 { global: _ZSt21ios_base_library_initv; local: *; };"
} > "$out/shim.map"
# link-time stand-in whose soname is the real library's full path: the shim's DT_NEEDED then names that file (a
# DT_NEEDED of "libstdc++.so.6" would resolve to the shim itself)
echo 'void ckpt_ci_alias(void) {}' > "$out/alias.c"
gcc -shared -fPIC -o "$out/alias.so" -Wl,-soname,"$real" "$out/alias.c"
gcc -shared -fPIC -O2 -o "$out/libstdc++.so.6" -Wl,-soname,libstdc++.so.6 -Wl,--version-script="$out/shim.map" \
    "$here/shim.c" -Wl,--no-as-needed "$out/alias.so"
