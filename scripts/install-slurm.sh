#!/usr/bin/env bash
# Slurm for the test suite (tests/test_slurm.py starts its own one-node cluster on loopback):
# Debian's slurm-wlm, installed when missing, as root, where apt-get exists. Elsewhere it says
# so and the Slurm tests skip (under CI=true they fail: CI must run them). Never fails the
# install itself.
set -u
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have slurmctld && have slurmd && have srun && have sbatch; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: Slurm is not installed and this is not a root Debian machine: tests/test_slurm.py" \
         "will skip (fail under CI=true). Install slurm-wlm to run them." >&2
    exit 0
fi
echo "installing Debian's slurm-wlm for the Slurm tests (apt-get)..." >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends slurm-wlm >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1
    apt-get install -y -q --no-install-recommends slurm-wlm >/dev/null 2>&1 \
        || echo "note: apt-get could not install slurm-wlm; tests/test_slurm.py will skip" \
                "(fail under CI=true)" >&2
fi
exit 0
