# shellcheck shell=bash disable=SC2034 # (ON_CGROUP2_WHERE, VM_KERNEL are read by the sourcing scripts)
# scripts/lib.sh: helpers sourced by scripts/test, scripts/vm, scripts/demo, scripts/bench.
#
#   ensure_venv             .venv with `pip install -e '.[dev]'`, reinstalled only when pyproject.toml changes
#   ensure_prometheus       .venv/bin/promtool and .venv/bin/prometheus, from Debian's prometheus
#                           package (downloaded once, unpacked only: no service is installed)
#   ensure_slurm            Debian's munge, slurmctld, slurmd and slurm-client on this filesystem, for
#                           the real-kernel Slurm test (apt, with a policy-rc.d that refuses every
#                           start, and the services disabled: they only ever run inside the VM)
#   host_has_cgroup2        true when this host itself is a usable cgroup v2 kernel (cgroup2 at
#                           /sys/fs/cgroup, writable, cpu+memory controllers, root)
#   ensure_vm_tools         qemu, a Debian kernel, busybox & co., systemd and dbus (apt, only what
#                           is missing) and virtme-ng in .venv-vm; sets VM_KERNEL
#   on_cgroup2 OUTDIR CMD   runs the bash command string CMD in the repo root, as root, on a real
#                           cgroup v2 kernel: natively if host_has_cgroup2, else in a virtme-ng VM
#                           (TCG, no KVM) with OUTDIR as its only writable host directory.
#                           Returns CMD's exit status. Sets ON_CGROUP2_WHERE to "natively" or
#                           "in a VM on kernel <release>".
#   ensure_runtimes         Debian's container runtimes (containerd, runc, podman, crun, docker.io)
#                           installed on the host's filesystem for the VM's tests, with nothing
#                           started and no service enabled on the host (see the function)
#
# Environment knobs:
#   NODEAGENT_FORCE_VM=1          use the VM even when the host has cgroup v2
#   NODEAGENT_VM_CPUS=2           guest CPUs
#   NODEAGENT_VM_MEMORY=2G        guest memory
#   NODEAGENT_VM_KERNEL=PATH      kernel image to boot (default: newest /boot/vmlinuz-* with modules)
#   NODEAGENT_VM_TIMEOUT=3600     seconds before a hung VM (or native run) is killed; ./scripts/test
#                                 sets it to what is left of its deadline
#
# CMD always gets NODEAGENT_REAL_KERNEL=1, PYTHONDONTWRITEBYTECODE=1 and .venv/bin first on PATH.
# In the VM the host's files are shared (same paths) under throwaway writable overlays on /etc,
# /usr, /var, /tmp, /opt, /home and /srv (writes are lost at power-off), /run is a tmpfs, and
# only OUTDIR is written back to the host.
set -euo pipefail

NODEAGENT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
NODEAGENT_VENV=$NODEAGENT_ROOT/.venv
NODEAGENT_VM_VENV=$NODEAGENT_ROOT/.venv-vm
# virtme-ng is pinned: its command line and guest behaviour are what on_cgroup2 relies on.
NODEAGENT_VNG_SPEC=${NODEAGENT_VNG_SPEC:-virtme-ng==1.42}
# What the host checks need beside .venv: pandoc, make and man-db for the man pages, which
# tests/unit/test_packaging.py renders with debian/rules' own recipe and checks with man --warnings.
NODEAGENT_UNIT_APT_PACKAGES=(pandoc make man-db)
# systemd and dbus: the kernel suite boots a real systemd with a system bus inside the VM
# (tests/kernel/systemd_host.py); the guest runs the host's own files.
NODEAGENT_VM_APT_PACKAGES=(qemu-system-x86 busybox-static binutils file kmod python3-venv systemd dbus iproute2 procps)
# The container runtimes the kernel suite starts inside the VM (tests/kernel/runtimes.py); never
# started on the host, whose cgroups are not v2 and belong to the machine.
NODEAGENT_RUNTIME_APT_PACKAGES=(containerd runc podman crun conmon docker.io iptables tini)
NODEAGENT_RUNTIME_UNITS=(containerd.service docker.service docker.socket podman.service podman.socket
  podman-restart.service podman-auto-update.service podman-auto-update.timer podman-clean-transient.service cni-dhcp.service cni-dhcp.socket)
ON_CGROUP2_WHERE=
VM_KERNEL=
_NODEAGENT_APT_UPDATED=

die() {
  echo "error: $*" >&2
  exit 1
}

note() { echo "$*" >&2; }

section() { printf '\n==> %s\n' "$*"; }

# run_logged DESCRIPTION CMD...: runs CMD with its output in a log; prints the log if CMD fails.
run_logged() {
  local what=$1 log rc=0
  shift
  log=$(mktemp "${TMPDIR:-/tmp}/nodeagent-log.XXXXXX")
  "$@" >"$log" 2>&1 || rc=$?
  if ((rc != 0)); then
    echo "error: $what failed (exit $rc): $*" >&2
    echo "----- log -----" >&2
    cat "$log" >&2
    echo "---------------" >&2
  fi
  rm -f "$log"
  return "$rc"
}

_apt_missing() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${db:Status-Status}\n' "$p" 2>/dev/null | grep -qx installed || echo "$p"
  done
}

# apt_install PKG...: installs the packages that are not installed yet (non-interactive, quiet).
apt_install() {
  local missing
  mapfile -t missing < <(_apt_missing "$@")
  ((${#missing[@]})) || return 0
  [[ $(id -u) -eq 0 ]] || die "missing packages ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
  note "installing ${missing[*]} (apt)..."
  if [[ -z $_NODEAGENT_APT_UPDATED ]]; then
    run_logged "apt-get update" env DEBIAN_FRONTEND=noninteractive \
      apt-get update -q -o DPkg::Lock::Timeout=600 || return 1
    _NODEAGENT_APT_UPDATED=1
  fi
  run_logged "apt-get install" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends -o DPkg::Lock::Timeout=600 \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${missing[@]}"
}

# apt_install_stopped PKG...: apt_install, with every service start refused (policy-rc.d exiting
# 101 for the duration: a policy-rc.d already there is put back after) and the packages' units
# disabled after, so that nothing they ship runs on this host, now or at its next boot.
apt_install_stopped() {
  local missing policy=/usr/sbin/policy-rc.d saved= rc=0 units
  mapfile -t missing < <(_apt_missing "$@")
  ((${#missing[@]})) || return 0
  [[ $(id -u) -eq 0 ]] || die "missing packages ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
  if [[ -e $policy || -L $policy ]]; then
    saved=$(mktemp "$policy.nodeagent.XXXXXX") && mv -f "$policy" "$saved" || return 1
  fi
  printf '#!/bin/sh\n# scripts/lib.sh: no service starts while nodeagent installs its test tools\nexit 101\n' >"$policy"
  chmod 0755 "$policy"
  apt_install "${missing[@]}" || rc=$?
  if [[ -n $saved ]]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi
  ((rc == 0)) || return "$rc"
  mapfile -t units < <(dpkg -L "${missing[@]}" 2>/dev/null | grep -E '^/(usr/)?lib/systemd/system/[^/]+\.(service|socket|timer)$' | xargs -r -n1 basename | sort -u)
  # offline: only the enablement links under /etc/systemd/system are removed
  ((${#units[@]} == 0)) || systemctl --no-reload disable "${units[@]}" >/dev/null 2>&1 || true
}

# ensure_slurm: Debian's Slurm (22.05 on Debian 12) and munge, for tests/kernel/test_slurm.py.
ensure_slurm() {
  _setup_lock
  apt_install_stopped munge slurmctld slurmd slurm-client
  local rc=$?
  _setup_unlock
  return "$rc"
}

# _make_venv DIR: (re)creates a working venv in DIR unless it already has a runnable python and pip.
_make_venv() {
  local dir=$1
  if [[ -x $dir/bin/python && -x $dir/bin/pip ]] && "$dir/bin/python" -c '' 2>/dev/null; then
    return 0
  fi
  # Debian's own interpreter where there is one: the one the package runs on (dh-virtualenv),
  # built with optimisations. A python3 found first on PATH may be neither: with pyenv's 3.11.7
  # (no --enable-optimizations; a loop twice as slow) ./scripts/test took 29.7 min on this
  # 2-core machine, and 20 min with Debian's 3.11.2 in a fresh Debian, its set-up included.
  local python=python3
  [[ -x /usr/bin/python3 ]] && python=/usr/bin/python3
  "$python" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv || return 1
  rm -rf "$dir"
  run_logged "creating $dir" "$python" -m venv "$dir"
}

# _setup_lock / _setup_unlock: serialise set-up (apt, venvs) between runs sharing this checkout.
# The lock is pyproject.toml itself (opened read-only), so it works on a read-only checkout too.
_NODEAGENT_LOCK_FD=
_setup_lock() {
  exec {_NODEAGENT_LOCK_FD}<"$NODEAGENT_ROOT/pyproject.toml" || return 0
  flock -w 1200 "$_NODEAGENT_LOCK_FD" 2>/dev/null ||
    note "waited 1200 s for the set-up lock (pyproject.toml: another run is installing); going on without it"
}
_setup_unlock() {
  [[ -n $_NODEAGENT_LOCK_FD ]] || return 0
  exec {_NODEAGENT_LOCK_FD}<&-
  _NODEAGENT_LOCK_FD=
}

ensure_venv() {
  local stamp=$NODEAGENT_VENV/.nodeagent-installed
  _setup_lock
  _make_venv "$NODEAGENT_VENV" || die "could not create $NODEAGENT_VENV"
  if [[ ! -e $stamp || $NODEAGENT_ROOT/pyproject.toml -nt $stamp ]]; then
    note "installing nodeagent and its dev dependencies into .venv..."
    run_logged "pip install -e '.[dev]'" "$NODEAGENT_VENV/bin/pip" install -q \
      --disable-pip-version-check -e "${NODEAGENT_ROOT}[dev]" || die "could not install the project into .venv"
    _install_import_linter || die "could not install import-linter into $NODEAGENT_VENV/lint-imports"
    touch "$stamp"
  fi
  _setup_unlock
}

# _install_import_linter: pyproject's `imports` extra into .venv/lint-imports (pip --target), off
# the venv's sys.path: scripts/test runs lint-imports with it on PYTHONPATH (see pyproject.toml).
_install_import_linter() {
  local target=$NODEAGENT_VENV/lint-imports specs
  mapfile -t specs < <("$NODEAGENT_VENV/bin/python" -c 'import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(*tomllib.load(f)["project"]["optional-dependencies"]["imports"], sep="\n")' \
    "$NODEAGENT_ROOT/pyproject.toml") && ((${#specs[@]})) || return 1
  rm -rf "$target"
  run_logged "pip install --target $target" "$NODEAGENT_VENV/bin/pip" install -q \
    --disable-pip-version-check --target "$target" "${specs[@]}"
}

# ensure_prometheus: Prometheus's promtool and server in .venv/bin, both from one download of
# Debian's prometheus package, unpacked, not installed (no service, no user, no
# /etc/prometheus): promtool checks scrapes and rules, and the unit tests start the server
# themselves, on loopback with its data in a temporary directory, to scrape a real endpoint
# with the ServiceMonitor's scrape config (tests/unit/test_service_monitor_scrape.py).
ensure_prometheus() {
  local bin=$NODEAGENT_VENV/bin tmp name rc=0
  [[ -x $bin/promtool && -x $bin/prometheus ]] && return 0
  command -v apt-get >/dev/null || die "promtool and prometheus come from Debian's prometheus package, and there is no apt-get"
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/nodeagent-prometheus.XXXXXX")
  _prometheus_download() { (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root prometheus); }
  if ! _prometheus_download >/dev/null 2>&1; then # no package lists yet: fetch them once
    [[ -n $_NODEAGENT_APT_UPDATED ]] || run_logged "apt-get update" env DEBIAN_FRONTEND=noninteractive \
      apt-get update -q -o DPkg::Lock::Timeout=600 || rc=$?
    _NODEAGENT_APT_UPDATED=1
    ((rc != 0)) || run_logged "apt-get download prometheus" _prometheus_download || rc=$?
  fi
  if ((rc == 0)); then
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/unpacked" || rc=$?
    for name in promtool prometheus; do
      ((rc != 0)) || install -m 0755 "$tmp/unpacked/usr/bin/$name" "$bin/$name" || rc=$?
    done
  fi
  rm -rf "$tmp"
  return "$rc"
}

host_has_cgroup2() {
  [[ $(id -u) -eq 0 ]] || return 1
  [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs ]] || return 1
  [[ -w /sys/fs/cgroup ]] || return 1 # read-only mounts (containers) don't count
  local controllers
  controllers=" $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null) " || return 1
  [[ $controllers == *" cpu "* && $controllers == *" memory "* ]]
}

# _find_kernel: newest /boot/vmlinuz-* that has its modules in /lib/modules (virtme-ng needs them).
_find_kernel() {
  local k v best=
  while read -r v; do
    k=/boot/vmlinuz-$v
    [[ -r $k && -e /lib/modules/$v/modules.dep ]] && best=$k
  done < <(find /boot -maxdepth 1 -name 'vmlinuz-*' -printf '%f\n' 2>/dev/null | sed 's/^vmlinuz-//' | sort -V)
  [[ -n $best ]] && echo "$best"
}

ensure_vm_tools() {
  [[ $(uname -m) == x86_64 ]] || die "the cgroup v2 VM is only set up for x86_64 hosts (this is $(uname -m))"
  local pkgs=("${NODEAGENT_VM_APT_PACKAGES[@]}")
  if [[ -n ${NODEAGENT_VM_KERNEL:-} ]]; then
    [[ -r $NODEAGENT_VM_KERNEL ]] || die "NODEAGENT_VM_KERNEL=$NODEAGENT_VM_KERNEL is not readable"
  elif ! _find_kernel >/dev/null; then
    pkgs+=(linux-image-amd64)
  fi
  _setup_lock
  local missing
  mapfile -t missing < <(_apt_missing "${pkgs[@]}")
  if ((${#missing[@]})); then
    note "setting up the cgroup v2 VM tools (once; a few minutes)..."
    apt_install "${missing[@]}" || die "could not install the VM tools"
  fi
  VM_KERNEL=${NODEAGENT_VM_KERNEL:-$(_find_kernel)} || die "no kernel in /boot with modules in /lib/modules"

  local stamp=$NODEAGENT_VM_VENV/.nodeagent-installed
  if [[ ! -e $stamp || $(<"$stamp") != "$NODEAGENT_VNG_SPEC" ]]; then
    _make_venv "$NODEAGENT_VM_VENV" || die "could not create $NODEAGENT_VM_VENV"
    run_logged "pip install $NODEAGENT_VNG_SPEC" "$NODEAGENT_VM_VENV/bin/pip" install -q \
      --disable-pip-version-check "$NODEAGENT_VNG_SPEC" || die "could not install virtme-ng"
    echo "$NODEAGENT_VNG_SPEC" >"$stamp"
  fi
  _setup_unlock
}

# ensure_runtimes: installs NODEAGENT_RUNTIME_APT_PACKAGES (only what is missing) with a
# /usr/sbin/policy-rc.d that exits 101 for the install, so that no maintainer script starts a
# runtime on the host, then disables every unit they enabled (`systemctl --root=/`, offline: no
# systemd is asked). An existing policy-rc.d is put back as it was.
ensure_runtimes() {
  local missing policy=/usr/sbin/policy-rc.d saved= rc=0
  mapfile -t missing < <(_apt_missing "${NODEAGENT_RUNTIME_APT_PACKAGES[@]}")
  ((${#missing[@]})) || return 0
  _setup_lock
  note "installing the container runtimes for the VM's tests (never started on this host)..."
  if [[ -e $policy ]]; then
    saved=$(mktemp "${TMPDIR:-/tmp}/nodeagent-policy-rc.XXXXXX")
    cp -p "$policy" "$saved"
  fi
  printf '#!/bin/sh\n# nodeagent scripts/lib.sh: start no service while the runtimes install\nexit 101\n' >"$policy"
  chmod 0755 "$policy"
  apt_install "${NODEAGENT_RUNTIME_APT_PACKAGES[@]}" || rc=$?
  if [[ -n $saved ]]; then
    cp -p "$saved" "$policy" && rm -f "$saved"
  else
    rm -f "$policy"
  fi
  local unit
  if ((rc == 0)) && command -v systemctl >/dev/null; then
    for unit in "${NODEAGENT_RUNTIME_UNITS[@]}"; do
      systemctl --root=/ --quiet disable "$unit" >/dev/null 2>&1 || true
    done
  fi
  _setup_unlock
  return "$rc"
}

# on_cgroup2 OUTDIR CMD...: see the header. CMD's words are joined with spaces into one bash string.
on_cgroup2() {
  (($# >= 2)) || die "usage: on_cgroup2 OUTDIR CMD..."
  local outdir=$1
  shift
  local cmd="$*"
  mkdir -p "$outdir" || die "cannot create $outdir"
  outdir=$(cd "$outdir" && pwd -P)
  local env_setup
  env_setup="export NODEAGENT_REAL_KERNEL=1 PYTHONDONTWRITEBYTECODE=1 PATH=$(printf %q "$NODEAGENT_VENV/bin"):\$PATH"

  if [[ ${NODEAGENT_FORCE_VM:-0} != 1 ]] && host_has_cgroup2; then
    ON_CGROUP2_WHERE=natively
    local native_rc=0
    (cd "$NODEAGENT_ROOT" && eval "$env_setup" &&
      exec timeout --kill-after=30 "${NODEAGENT_VM_TIMEOUT:-3600}" bash -c "$cmd") || native_rc=$?
    if ((native_rc == 124 || native_rc == 137)); then
      echo "error: the command timed out after ${NODEAGENT_VM_TIMEOUT:-3600}s (NODEAGENT_VM_TIMEOUT)" >&2
    fi
    return "$native_rc"
  fi

  ensure_vm_tools
  # Per-call control files, inside OUTDIR (the one directory the guest can write) so concurrent
  # calls sharing an OUTDIR don't collide. The guest leaves the command's exit status there:
  # vng's own exit status is not trusted to be the guest command's.
  local ctl
  ctl=$(mktemp -d "$outdir/.on_cgroup2.XXXXXX") || die "cannot write to $outdir"
  # listed and packed here, where it takes seconds; the guest unpacks, copies and mounts them
  bash "$NODEAGENT_ROOT/scripts/guest-code-in-ram" list "$NODEAGENT_VENV/bin/python" "$ctl" || true
  cat >"$ctl/cmd.sh" <<EOF
# generated by scripts/lib.sh on_cgroup2; runs inside the VM
uname -r > $(printf %q "$ctl/kernel")
# loopback up (the metrics tests listen on 127.0.0.1): virtme-ng's init leaves it down where
# iproute2 is missing, as on a minimal Debian; busybox-static is one of the VM tools
ip link set lo up 2>/dev/null || busybox ip link set lo up
$env_setup
# the code every Python process maps, onto the guest's tmpfs (see the script)
bash $(printf %q "$NODEAGENT_ROOT/scripts/guest-code-in-ram") mount $(printf %q "$ctl")
# /root and the checkout are read-only in the guest; keep HOME, hypothesis & co. on the tmpfs
export HOME=/tmp/nodeagent-home HYPOTHESIS_STORAGE_DIRECTORY=/tmp/nodeagent-hypothesis
mkdir -p "\$HOME"
if cd $(printf %q "$NODEAGENT_ROOT"); then
  bash -c $(printf %q "$cmd")
  rc=\$?
else
  echo "error: the checkout $(printf %q "$NODEAGENT_ROOT") is not visible inside the VM (is it under /run or /var?)" >&2
  rc=97
fi
echo "\$rc" > $(printf %q "$ctl/rc")
EOF
  # qemu reopens /proc/self/fd/1 and 2 (O_TRUNC, own offsets): given a regular file it would
  # clobber it, so its output always goes through pipes (stdout to stdout, stderr to stderr).
  local vng_rc=0
  {
    {
      PATH=$NODEAGENT_VM_VENV/bin:$PATH timeout --kill-after=30 "${NODEAGENT_VM_TIMEOUT:-3600}" \
        "$NODEAGENT_VM_VENV/bin/vng" --disable-kvm --run "$VM_KERNEL" --user root \
        --cpus "${NODEAGENT_VM_CPUS:-2}" --memory "${NODEAGENT_VM_MEMORY:-2G}" \
        --rwdir "$outdir" --cwd / --exec "bash $(printf %q "$ctl/cmd.sh")" </dev/null 2>&1 1>&5 5>&- ||
        echo "$?" >"$ctl/vng-rc"
    } | cat >&2
  } 5>&1 | cat
  [[ -s $ctl/vng-rc ]] && vng_rc=$(<"$ctl/vng-rc")
  if [[ ! -s $ctl/rc ]]; then
    if ((vng_rc == 124 || vng_rc == 137)); then
      echo "error: the VM timed out after ${NODEAGENT_VM_TIMEOUT:-3600}s (NODEAGENT_VM_TIMEOUT)" >&2
    else
      echo "error: the VM (vng, exit $vng_rc) did not report the command's exit status: it failed to boot or crashed" >&2
    fi
    ON_CGROUP2_WHERE="in a VM that failed"
    rm -rf "$ctl"
    return 125
  fi
  ON_CGROUP2_WHERE="in a VM on kernel $(cat "$ctl/kernel" 2>/dev/null || basename "$VM_KERNEL")"
  local rc
  rc=$(<"$ctl/rc")
  rm -rf "$ctl"
  return "$rc"
}
