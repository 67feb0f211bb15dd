#!/usr/bin/env bash
# System packages the tests and the fast path use, from Debian/Ubuntu's archive (never a download
# of our own): chromium drives the dashboard's browser tests, libtcmalloc-minimal4 is the allocator
# trajflow preloads into its Ray workers (trajflow/infra/allocator.py).
# Installs what is missing when it can (root with apt-get); otherwise says what is missing and
# exits 0: the browser tests then skip with the install command, and glibc's allocator is used.
set -u
need=()
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need+=(libtcmalloc-minimal4)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
    exit 0
  fi
  echo "warning: apt-get could not install ${need[*]}" >&2
fi
echo "note: missing system packages ${need[*]}; install them with: sudo apt-get install -y ${need[*]}" >&2
exit 0
