from sample.cli import main

main()
