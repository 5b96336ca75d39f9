from megamoe.cli import main

main()
