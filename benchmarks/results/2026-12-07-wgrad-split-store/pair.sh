# runs call scripts one after another, each under its own $OUT subfolder: bash .gpu/pair.sh 14 17
O=$OUT; for c in "$@"; do mkdir -p $O/c$c; echo "##### call $c"; OUT=$O/c$c bash .gpu/call_$c.sh 2>&1 | tail -30; done
