r"""Writes apps_mini.jsonl and apps_fewshot.jsonl: small problems in the APPS record format.

Written for this project (not from APPS): short statements, 3-5 tests each, one or two reference
solutions. Expected outputs are computed here by running the first reference solution (our own
trusted code, run in this process), so the statement, tests and solutions agree by construction.

  python -m experiments.data.make_apps_mini
"""

import contextlib
import io
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

# (id, question, kind, tests, solutions, fn_name/starter)
STDIN = [
    ('sum_two', 'Read two integers a and b on one line and print their sum.',
     ['1 2\n', '40 2\n', '-5 5\n', '100 250\n'],
     ['a, b = map(int, input().split())\nprint(a + b)\n']),
    ('max_list', 'The first line holds n. The second line holds n integers. Print the largest.',
     ['3\n1 9 4\n', '1\n-7\n', '5\n2 2 8 8 1\n'],
     ['n = int(input())\nprint(max(map(int, input().split())))\n']),
    ('reverse_string', 'Read a string and print it reversed.',
     ['hello\n', 'abc\n', 'racecar\n', 'ab cd\n'],
     ['print(input()[::-1])\n']),
    ('count_vowels', 'Read a line and print how many of its letters are vowels (aeiou).',
     ['hello\n', 'sky\n', 'education\n'],
     ["s = input()\nprint(sum(c in 'aeiou' for c in s))\n"]),
    ('factorial', 'Read n (0 <= n <= 20) and print n factorial.',
     ['0\n', '5\n', '10\n', '20\n'],
     ['n = int(input())\nr = 1\nfor i in range(2, n + 1):\n    r *= i\nprint(r)\n']),
    ('is_prime', 'Read n (n >= 1). Print YES if n is prime, else NO.',
     ['2\n', '1\n', '17\n', '21\n', '97\n'],
     ["n = int(input())\nok = n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n"
      "print('YES' if ok else 'NO')\n"]),
    ('fizzbuzz', 'Read n. For i from 1 to n print Fizz if 3 divides i, Buzz if 5 divides i, '
     'FizzBuzz if both, else i.',
     ['5\n', '15\n', '1\n'],
     ["n = int(input())\nfor i in range(1, n + 1):\n    s = ''\n    if i % 3 == 0:\n"
      "        s += 'Fizz'\n    if i % 5 == 0:\n        s += 'Buzz'\n    print(s or i)\n"]),
    ('digit_sum', 'Read a non-negative integer and print the sum of its digits.',
     ['123\n', '0\n', '9999\n'],
     ['print(sum(int(c) for c in input().strip()))\n']),
    ('palindrome', 'Read a word. Print YES if it reads the same backwards, else NO.',
     ['level\n', 'hello\n', 'a\n', 'abba\n'],
     ["s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n"]),
    ('gcd', 'Read two positive integers and print their greatest common divisor.',
     ['12 18\n', '7 13\n', '100 75\n'],
     ['import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n']),
    ('fibonacci', 'Read n (0 <= n <= 50) and print the n-th Fibonacci number (F0 = 0, F1 = 1).',
     ['0\n', '1\n', '10\n', '50\n'],
     ['n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n']),
    ('sort_numbers', 'Read integers on one line and print them sorted ascending, space separated.',
     ['3 1 2\n', '5\n', '9 -1 4 4\n'],
     ["print(' '.join(map(str, sorted(map(int, input().split())))))\n"]),
    ('count_words', 'Read a line and print how many words (separated by spaces) it holds.',
     ['hello world\n', 'one\n', 'a b c d e\n'],
     ['print(len(input().split()))\n']),
    ('min_three', 'Read three integers on one line and print the smallest.',
     ['3 1 2\n', '-4 0 9\n', '7 7 7\n'],
     ['print(min(map(int, input().split())))\n']),
    ('fahrenheit', 'Read a temperature in Celsius and print it in Fahrenheit with two decimals.',
     ['0\n', '100\n', '-40\n', '36.6\n'],
     ["c = float(input())\nprint('%.2f' % (c * 9 / 5 + 32))\n"]),
    ('even_odd', 'Read an integer. Print EVEN if it is even, else ODD.',
     ['4\n', '7\n', '0\n', '-3\n'],
     ["n = int(input())\nprint('EVEN' if n % 2 == 0 else 'ODD')\n"]),
    ('square_sum', 'Read n and print 1*1 + 2*2 + ... + n*n.',
     ['1\n', '3\n', '10\n'],
     ['n = int(input())\nprint(sum(i * i for i in range(1, n + 1)))\n']),
    ('upper_case', 'Read a line and print it in upper case.',
     ['hello\n', 'Mixed Case\n', 'abc1\n'],
     ['print(input().upper())\n']),
]

CALL = [
    ('add', 'Write add(a, b) returning the sum of two integers.', 'add',
     [[1, 2], [-3, 3], [10, 20]],
     ['class Solution:\n    def add(self, a, b):\n        return a + b\n']),
    ('reverse_list', 'Write reverse_list(xs) returning the list reversed.', 'reverse_list',
     [[[1, 2, 3]], [[]], [[5, 4]]],
     ['class Solution:\n    def reverse_list(self, xs):\n        return xs[::-1]\n']),
    ('is_palindrome', 'Write is_palindrome(s) returning True if s reads the same backwards.',
     'is_palindrome', [['abba'], ['abc'], ['x']],
     ['class Solution:\n    def is_palindrome(self, s):\n        return s == s[::-1]\n']),
    ('count_char', 'Write count_char(s, c) returning how many times c occurs in s.', 'count_char',
     [['banana', 'a'], ['apple', 'z'], ['aaa', 'a']],
     ['class Solution:\n    def count_char(self, s, c):\n        return s.count(c)\n']),
    ('square_all', 'Write square_all(xs) returning the list of the squares of xs.', 'square_all',
     [[[1, 2, 3]], [[-2]], [[]]],
     ['class Solution:\n    def square_all(self, xs):\n        return [x * x for x in xs]\n']),
    ('max_diff', 'Write max_diff(xs) returning the largest minus the smallest element.',
     'max_diff', [[[1, 5, 3]], [[4]], [[-2, 8]]],
     ['class Solution:\n    def max_diff(self, xs):\n        return max(xs) - min(xs)\n']),
    ('two_sum', 'Write two_sum(nums, target) returning the indices [i, j], i < j, of the two '
     'numbers that add up to target.', 'two_sum',
     [[[2, 7, 11, 15], 9], [[3, 2, 4], 6], [[1, 5, 1, 5], 10]],
     ['class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n'
      '        for j, x in enumerate(nums):\n            if target - x in seen:\n'
      '                return [seen[target - x], j]\n            seen[x] = j\n']),
    ('sum_even', 'Write sum_even(xs) returning the sum of the even numbers in xs.', 'sum_even',
     [[[1, 2, 3, 4]], [[1, 3]], [[10, -2]]],
     ['class Solution:\n    def sum_even(self, xs):\n        return sum(x for x in xs if x % 2 == 0)\n']),
    ('capitalize', 'Write capitalize(s) returning s with the first letter of every word in upper '
     'case.', 'capitalize', [['hello world'], ['a'], ['python is fun']],
     ["class Solution:\n    def capitalize(self, s):\n"
      "        return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))\n"]),
    ('count_positive', 'Write count_positive(xs) returning how many elements are > 0.',
     'count_positive', [[[1, -2, 3]], [[]], [[0, 0, 5]]],
     ['class Solution:\n    def count_positive(self, xs):\n        return sum(1 for x in xs if x > 0)\n']),
]

FEWSHOT_STDIN = ('square', 'Read an integer n and print n squared.', ['3\n', '-4\n', '0\n'],
                 ['n = int(input())\nprint(n * n)\n'])
FEWSHOT_CALL = ('double', 'Write double(x) returning x times two.', 'double', [[2], [-1], [0]],
                ['class Solution:\n    def double(self, x):\n        return 2 * x\n'])


def _run_stdin(source: str, data: str) -> str:
  import sys
  out, old_in = io.StringIO(), sys.stdin
  sys.stdin = io.StringIO(data)
  try:
    with contextlib.redirect_stdout(out):
      exec(source, {'__name__': '__main__'})
  finally:
    sys.stdin = old_in
  return out.getvalue()


def _starter(fn: str, args) -> str:
  names = ', '.join(['self'] + [f'arg{i}' for i in range(len(args))])
  return f'class Solution:\n    def {fn}({names}):\n'


def _stdin_record(pid, question, inputs, solutions):
  outputs = [_run_stdin(solutions[0], i) for i in inputs]
  return dict(problem_id=pid, question=question, starter_code='', difficulty='introductory',
              input_output=json.dumps({'inputs': inputs, 'outputs': outputs}),
              solutions=json.dumps(solutions))


def _call_record(pid, question, fn, inputs, solutions):
  scope = {}
  exec(solutions[0], scope)
  method = getattr(scope['Solution'](), fn)
  outputs = [method(*args) for args in inputs]
  starter = _starter(fn, inputs[0])
  return dict(problem_id=pid, question=question, starter_code=starter,
              difficulty='introductory',
              input_output=json.dumps({'inputs': inputs, 'outputs': outputs, 'fn_name': fn}),
              solutions=json.dumps(solutions))


def main():
  records = [_stdin_record(*p) for p in STDIN] + [_call_record(*p) for p in CALL]
  with open(os.path.join(HERE, 'apps_mini.jsonl'), 'w') as f:
    for r in records:
      f.write(json.dumps(r, sort_keys=True) + '\n')
  with open(os.path.join(HERE, 'apps_fewshot.jsonl'), 'w') as f:
    for r in (_stdin_record(*FEWSHOT_STDIN), _call_record(*FEWSHOT_CALL)):
      f.write(json.dumps(r, sort_keys=True) + '\n')
  print(f'{len(records)} problems, 2 few-shot examples')


if __name__ == '__main__':
  main()
