from mocli.cli import main

main()
