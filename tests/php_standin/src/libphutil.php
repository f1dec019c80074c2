<?php

// The few libphutil functions and environment classes the bridge's PHP calls.

function id($object) {
  return $object;
}

function idx(array $dict, $key, $default = null) {
  return array_key_exists($key, $dict) ? $dict[$key] : $default;
}

function pht($text) {
  $args = func_get_args();
  array_shift($args);
  return vsprintf($text, $args);
}

function coalesce() {
  foreach (func_get_args() as $arg) {
    if ($arg !== null) {
      return $arg;
    }
  }
  return null;
}

function newv($class, array $args) {
  $reflection = new ReflectionClass($class);
  return $reflection->newInstanceArgs($args);
}

// Invalid bytes become U+FFFD, as libphutil's does.
function phutil_utf8ize($string) {
  $out = '';
  $offset = 0;
  while ($offset < strlen($string)) {
    if (preg_match('/\G[\x00-\x7F]|\G[\xC2-\xDF][\x80-\xBF]|\G[\xE0-\xEF][\x80-\xBF]{2}|\G[\xF0-\xF4][\x80-\xBF]{3}/', $string, $match, 0, $offset)) {
      $out .= $match[0];
      $offset += strlen($match[0]);
    } else {
      $out .= "\xEF\xBF\xBD";
      $offset++;
    }
  }
  return $out;
}

function phutil_microseconds_since($t_start) {
  return (int)round((microtime(true) - $t_start) * 1000000);
}

final class PhabricatorEnv {
  public static function isReadOnly() {
    $flag = getenv('STANDIN_READ_ONLY_FILE');
    return $flag && file_exists($flag);
  }
}

final class PhabricatorCaches {
  private static $requestCache = array();

  public static function destroyRequestCache() {
    self::$requestCache = array();
  }

  public static function getRequestCache() {
    return self::$requestCache;
  }

  public static function setRequestCache($key, $value) {
    self::$requestCache[$key] = $value;
  }
}
