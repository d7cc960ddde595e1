#!/usr/bin/env bash
# The first thing to run on a new trn2 host: build the neuron image and run the runner in it on five small
# real Hub models — one that fits one core, a dense model forced to TP over 2 cores, a MoE over 4 cores with
# expert parallelism, an embedder, a text-to-image pipeline — then print the driver, runtime and compiler
# versions found, the stack the host's workers will serve with its job queues, and a table of verdict, cores,
# wall, compile and peak memory. Exit status 0 only when the stack is found and all five PASS.
#
#   scripts/trn2-check.sh                                   the neuron image, /dev/neuron*, Hub models
#   scripts/trn2-check.sh --backend cpu --no-docker --models DIR
#                                                           the same check here, on tiny checkpoints
#                                                           (python -m testing.tiny_models DIR)
# Options:
#   --backend neuron|cpu   the runner's backend (default neuron)
#   --no-docker            run scripts/trn2_check.py with this checkout's .venv (or $PYTHON) instead
#   --models DIR           tiny checkpoints instead of the Hub models
#   --parallel             run the five at once (they use disjoint cores: 0, 2-3, 4-7, 8, 9)
#   --image TAG            the image to build and run (default supportmatrix:neuron)
#   --user USER            run the container as USER (e.g. 10001, the image's `app`): does Neuron work without root?
#   --compile-backend B    the cpu backend's dynamo backend (SUPPORTMATRIX_CPU_COMPILE_BACKEND, e.g. aot_eager)
#   --calibration PATH     where the file for the verdict's calibration goes (default trn2-check-calibration.json):
#                          per check, every step's logit difference against the CPU reference and the compile path
# The Hub and compile caches are the stack's named volumes (supportmatrix-hf-home, supportmatrix-compile-cache);
# HF_TOKEN and HF_ENDPOINT are passed on when set.
set -euo pipefail
cd "$(dirname "$0")/.."

backend=neuron docker=1 models="" image=supportmatrix:neuron user="" pass=() calibration=trn2-check-calibration.json
while (($#)); do
    case "$1" in
        --backend) backend="$2"; shift 2 ;;
        --no-docker) docker=0; shift ;;
        --models) models="$2"; shift 2 ;;
        --parallel) pass+=(--parallel); shift ;;
        --image) image="$2"; shift 2 ;;
        --user) user="$2"; shift 2 ;;
        --compile-backend) export SUPPORTMATRIX_CPU_COMPILE_BACKEND="$2"; shift 2 ;;
        --calibration) calibration="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done

if ((docker == 0)); then
    python="${PYTHON:-.venv/bin/python}"
    [[ -n "$models" ]] && pass+=(--models "$models")
    exec "$python" scripts/trn2_check.py --backend "$backend" --calibration "$calibration" "${pass[@]}"
fi

# --- in the neuron image ------------------------------------------------------------------------------------
command -v docker >/dev/null || { echo "docker not found: install Docker, or use --no-docker" >&2; exit 2; }
if [[ "$backend" == neuron ]]; then
    shopt -s nullglob
    devices=(/dev/neuron[0-9]*)
    if ((${#devices[@]} == 0)); then
        echo "no /dev/neuron* on this host: install the Neuron driver (aws-neuronx-dkms) first" >&2
        exit 2
    fi
    echo "host: Neuron driver $(cat /sys/module/neuron/version 2>/dev/null || echo '?'), ${#devices[@]} devices"
fi
docker build -f Dockerfile.neuron -t "$image" .

run=(docker run --rm --entrypoint python
     -v supportmatrix-hf-home:/hf -v supportmatrix-compile-cache:/cache
     -e HF_TOKEN -e HF_ENDPOINT -e SUPPORTMATRIX_CPU_COMPILE_BACKEND)
if [[ "$backend" == neuron ]]; then
    for device in "${devices[@]}"; do run+=(--device "$device:$device"); done
    run+=(--cap-add IPC_LOCK --cap-add SYS_ADMIN --ulimit memlock=-1 --shm-size 64g)
fi
[[ -n "$user" ]] && run+=(--user "$user")
if [[ -n "$models" ]]; then
    run+=(-v "$(cd "$models" && pwd):/models:ro")
    pass+=(--models /models)
fi
out="$(cd "$(dirname "$calibration")" && pwd)"  # the calibration file comes back through a mount
run+=(-v "$out:/out")
exec "${run[@]}" "$image" scripts/trn2_check.py --backend "$backend" --calibration "/out/$(basename "$calibration")" \
    "${pass[@]}"
