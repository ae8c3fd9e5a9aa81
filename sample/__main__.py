from train.sample_cli import main

main()
