#!/usr/bin/env bash
# Install what tests/cluster needs: a real Slurm 22.05 from Debian (slurmctld, slurmd, slurmdbd and the
# clients), munge, and MariaDB for slurmdbd (so that sacct reports each job's state and exit code).
# Root only; idempotent (installs nothing when everything is there); starts no service (the test starts
# its own daemons, by PID, in a temporary directory). Where it cannot run it says why and exits 0, and
# the tests then skip with their own reason.
#   bash tests/cluster/install.sh
# Cost (measured on a Debian 12 machine with none of them, --no-install-recommends): 27 new packages, 21.7 MB of
# archives, 204 MB on disk, 83 s with the download (load average 11 on 2 cores). A second run: 0 s. The packages
# enable their services for the next boot (systemd); none is started now.
set -euo pipefail
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)
BINARIES=(slurmctld slurmd slurmdbd sbatch sacct munged mariadbd mariadb-install-db)

have_all() {
  local b
  for b in "${BINARIES[@]}"; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || return 1
  done
}

if have_all; then
  echo "tests/cluster/install.sh: Slurm, munge and MariaDB are installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/cluster/install.sh: skipped: installing Slurm needs root (run it with sudo)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "tests/cluster/install.sh: skipped: no apt-get (the test cluster uses Debian's slurm-wlm packages)"
  exit 0
fi
# Keep the packages' own services from starting (the test runs its own daemons); restore the policy after.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$POLICY"
  chmod +x "$POLICY"
  ADDED_POLICY=1
fi
trap '[ "$ADDED_POLICY" = 1 ] && rm -f "$POLICY"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
have_all
echo "tests/cluster/install.sh: installed ${PACKAGES[*]}"
