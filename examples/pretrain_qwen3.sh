#!/bin/bash
# Launch the reference run: 8 processes over the two hosts of ./hostfile.
# Run from the directory holding pretrain_config.yaml and hostfile, e.g.
#   nohup ./pretrain_qwen3.sh > pretrain.log 2>&1 &
#   tail -f pretrain.log
# Ascend: the runtime reads ASCEND_RT_VISIBLE_DEVICES; CANN_VISIBLE_DEVICES (the reference document's name) is
# exported beside it for tools that read that one. NVIDIA: export CUDA_VISIBLE_DEVICES=0,1,2,3 instead.
# mpirun only starts the processes; the rendezvous uses master_addr/master_port from the config.
# -x passes the environment to the remote host (PATH must find the same python/venv there).
export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3
export CANN_VISIBLE_DEVICES=$ASCEND_RT_VISIBLE_DEVICES
export PYTHONPATH=$PWD:$PYTHONPATH
QWEN3_PRETRAIN_HOME=${QWEN3_PRETRAIN_HOME:-$(cd "$(dirname "$0")/.." && pwd)}

mpirun -np 8 -hostfile hostfile -x PATH -x PYTHONPATH -x ASCEND_RT_VISIBLE_DEVICES -x CANN_VISIBLE_DEVICES \
    python "$QWEN3_PRETRAIN_HOME/tools/train.py" --config pretrain_config.yaml
