from benchmarks.gpu.step import main

main()
