#!/bin/bash
# Starts argparse_ranks.py once per rank in the background and waits for them all, as a job script
# written by hand does. Usage: bash launch_ranks.sh INIT_METHOD (tcp://127.0.0.1:PORT or file:///PATH)
here=$(dirname "$0")
python "$here/argparse_ranks.py" --rank 0 --world-size 2 --init-method "$1" &
python "$here/argparse_ranks.py" --rank 1 --world-size 2 --init-method "$1" &
wait
