from mha2gqa.cli import main

main()
