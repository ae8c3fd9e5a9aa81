from train.cli import main

main()
