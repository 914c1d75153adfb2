export PYTHONPATH=$PWD
which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null || { echo "no ncu"; exit 0; }
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
python scratch/ncu_gate_up.py && echo warm
timeout 120 $NCU --launch-skip 0 --launch-count 4 -k "regex:grouped_gemm|cutlass|device_kernel" --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python scratch/ncu_gate_up.py > $OUT/ncu.txt 2>&1
echo rc $?
grep -v "^==PROF==" $OUT/ncu.txt | grep -i "grouped_gemm_kernel\|device_kernel\|Throughput\|Duration\|L2 Cache\|Pipe\|Issue Slots\|Executed Ipc\|Shared\|ERR" | head -80
