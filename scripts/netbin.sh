#!/usr/bin/env bash
# Copy this machine's iproute2 (ip, tc) with its own loader and libraries into .netbin/, for a
# machine without iproute2 (the lent device machine): scripts/device_bench.sh puts it on PATH
# there. The wrappers run the binaries through the copied loader with --library-path, so nothing
# leaks into what `ip netns exec` starts. Also records the commit the tree is at (.netbin/COMMIT).
# .netbin/ is ignored (.git/info/exclude): carry it with the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.netbin/' .git/info/exclude 2>/dev/null || echo '/.netbin/' >> .git/info/exclude
rm -rf .netbin && mkdir -p .netbin/lib
for b in ip tc; do
    bin=$(command -v "$b")
    cp "$bin" ".netbin/$b.bin"
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}' | while read -r lib; do
        cp -L "$lib" .netbin/lib/
    done
    cat > ".netbin/$b" <<WRAP
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")
exec "\$d/lib/$(basename "$(ldd "$bin" | awk '$1 ~ /ld-linux/ {print $1}')")" --library-path "\$d/lib" --argv0 $b "\$d/$b.bin" "\$@"
WRAP
    chmod +x ".netbin/$b"
done
git rev-parse --short HEAD > .netbin/COMMIT
.netbin/ip -V && .netbin/tc -V && du -sh .netbin
